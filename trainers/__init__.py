"""Training NAtS-L models: data, configs, checkpoints and the loop."""

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import PRESETS, TASKS, TrainConfig, preset, run_config
from .data import Batches, build_batches
from .loop import TrainResult, evaluate, resolve_device, train
from .synthetic import CopyTask, MQARTask
from .text import ByteWindows, decode_tokens, encode_text, generate_text, load_byte_splits

__all__ = [
    "PRESETS",
    "TASKS",
    "Batches",
    "ByteWindows",
    "CopyTask",
    "MQARTask",
    "TrainConfig",
    "TrainResult",
    "build_batches",
    "decode_tokens",
    "encode_text",
    "evaluate",
    "generate_text",
    "latest_checkpoint",
    "load_byte_splits",
    "load_checkpoint",
    "preset",
    "resolve_device",
    "run_config",
    "save_checkpoint",
    "train",
]
