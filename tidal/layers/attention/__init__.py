from tidal.layers.attention.layer import Attention  # noqa: F401
from tidal.layers.attention.metadata import AttentionMetadata  # noqa: F401
