from tidal.layers.attention.layer import Attention  # noqa: F401
