"""deepep-nccl's drop-in for DeepEP V1's `deep_ep` package (needs PyTorch with CUDA)."""
from deep_ep_cpp import Config, topk_idx_t

from .buffer import Buffer
from .utils import EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]

# The DeepEP V1 release whose API this package implements (scripts print or compare it).
__version__ = "1.2.1"
