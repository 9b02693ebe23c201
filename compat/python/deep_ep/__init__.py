"""deepep-nccl's drop-in for DeepEP V1's `deep_ep` package (needs PyTorch with CUDA)."""
from deep_ep_cpp import Config, topk_idx_t

from ._version import __version__
from .buffer import Buffer
from .utils import EventOverlap

__all__ = ["Buffer", "Config", "EventOverlap", "topk_idx_t"]
