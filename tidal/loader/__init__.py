from tidal.loader.loader import LoadedModel, load_model, resolve_model_path  # noqa: F401
