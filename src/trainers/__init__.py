"""Training NAtS-L models: data, configs, checkpoints and the loop."""

from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .config import PRESETS, TASKS, TrainConfig, preset, run_config
from .data import Batches, build_batches
from .distributed import World, resolve_device
from .evaluation import Evaluation, evaluate
from .loop import TrainResult, train
from .synthetic import CopyTask, MQARTask, NeedleTask
from .text import generate_text
from .text_data import Corpus, StreamWindows, TokenWindows, load_text_sources, resolve_corpus
from .tokenization import ByteTokenizer, FileTokenizer, load_tokenizer

__all__ = [
    "PRESETS",
    "TASKS",
    "Batches",
    "ByteTokenizer",
    "CopyTask",
    "Corpus",
    "Evaluation",
    "FileTokenizer",
    "MQARTask",
    "NeedleTask",
    "StreamWindows",
    "TokenWindows",
    "TrainConfig",
    "TrainResult",
    "World",
    "build_batches",
    "evaluate",
    "generate_text",
    "latest_checkpoint",
    "load_checkpoint",
    "load_text_sources",
    "load_tokenizer",
    "preset",
    "resolve_corpus",
    "resolve_device",
    "run_config",
    "save_checkpoint",
    "train",
]
