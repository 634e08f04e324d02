"""Data parallel training under torchrun (two CPU processes over Gloo) against one process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from nats import NatsForCausalLM
from nats.trainers import latest_checkpoint, train

from .conftest import MicroConfig

pytestmark = pytest.mark.slow  # worker processes

WORKER = """
import json, sys
from nats.trainers import TrainConfig, train
config = TrainConfig.from_dict(json.loads(open(sys.argv[1]).read()))
evals = []
result = train(config, on_eval=lambda step, metrics, model: evals.append(step))
rank = int(__import__("os").environ["RANK"])
open(f"{sys.argv[2]}.evals{rank}", "w").write(json.dumps(evals))
if rank == 0:
    open(sys.argv[2], "w").write(json.dumps(result.train_losses))
"""


@pytest.mark.slow
def test_two_processes_follow_the_single_process_run(micro: MicroConfig,
                                                     tmp_path: Path) -> None:
    # No budget: its gradient is centred per process (as batch norm's is). The routing
    # statistics are summed over processes before each commit, so they follow exactly.
    model = micro().model.replace(vocab_size=64, softmax_target=None)
    common = dict(task="mqar", batch_size=4, seq_len=32, mqar_pairs=4, model=model)
    single = train(micro(**common, out_dir=str(tmp_path / "single")))

    config = micro(**common, grad_accum_steps=2, out_dir=str(tmp_path / "ddp"))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "worker.py").write_text(WORKER)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(tmp_path / "worker.py"), str(tmp_path / "config.json"),
         str(tmp_path / "losses.json")],
        capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]

    losses = json.loads((tmp_path / "losses.json").read_text())
    assert losses == pytest.approx(single.train_losses, rel=1e-5)
    # Evaluated once per interval, by rank 0 alone.
    assert [json.loads((tmp_path / f"losses.json.evals{r}").read_text()) for r in (0, 1)] == \
        [[3, 6], []]
    ddp_model = NatsForCausalLM.from_pretrained(tmp_path / "ddp" / "model")
    for (name, a), (_, b) in zip(single.model.state_dict().items(),
                                 ddp_model.state_dict().items(), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5, msg=name)
    # Only rank 0 wrote: one events file, one checkpoint folder.
    assert len(list((tmp_path / "ddp").glob("events.out.tfevents.*"))) == 1


@pytest.mark.parametrize("noise", [{"route_explore": 0.5}, {"sampler": "gumbel"}])
def test_routing_noise_is_refused_across_processes(micro: MicroConfig, noise: dict) -> None:
    """Every rank seeds alike, so each would draw the same routing noise for its rows:
    refused in one line before anything is built, rather than trained quietly wrong."""
    import contextlib

    from nats.trainers.distributed import World
    from nats.trainers.loop import _train

    config = micro(route_explore=noise.get("route_explore", 0.0),
                   model=micro().model.replace(sampler=noise.get("sampler", "argmax")))
    with pytest.raises(ValueError, match="same routing noise"), contextlib.ExitStack() as hold:
        _train(config, False, None, World(size=2), torch.device("cpu"), hold)
    assert not Path(config.out_dir).exists()


STOPPING_WORKER = """
import json, os, sys
from pathlib import Path
from nats.trainers import TrainConfig, train
config = TrainConfig.from_dict(json.loads(open(sys.argv[1]).read()))
rank = os.environ["RANK"]
Path(sys.argv[2], f"pid{rank}").write_text(str(os.getpid()))
result = train(config, resume=len(sys.argv) > 3)
Path(sys.argv[2], f"result{rank}.json").write_text(
    json.dumps({"interrupted": result.interrupted, "step": result.step}))
"""


def test_a_sigterm_to_one_rank_stops_every_rank_at_one_checkpoint(micro: MicroConfig,
                                                                  tmp_path: Path) -> None:
    """A scheduler's SIGTERM reaches ranks at different moments (here: rank 1 only); a rank
    that stopped alone would leave the others waiting in the next all-reduce."""
    config = micro(steps=100_000, checkpoint_interval=5, eval_interval=100_000,
                   log_interval=100_000, out_dir=str(tmp_path / "ddp"))
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "worker.py").write_text(STOPPING_WORKER)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(tmp_path / "worker.py"), str(tmp_path / "config.json"), str(tmp_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while latest_checkpoint(tmp_path / "ddp") is None and proc.poll() is None:
            time.sleep(0.2)  # training is under way once the first checkpoint is written
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        os.kill(int((tmp_path / "pid1").read_text()), signal.SIGTERM)
        _, err = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert all(r["interrupted"] for r in results)
    assert results[0]["step"] == results[1]["step"] < 100_000
    assert latest_checkpoint(tmp_path / "ddp").name == f"step_{results[0]['step']:08d}.safetensors"

    # Resumed under torchrun: every rank restores the checkpoint, one says so.
    stopped = results[0]["step"]
    (tmp_path / "config.json").write_text(json.dumps(config.replace(steps=stopped + 2).to_dict()))
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         "2", str(tmp_path / "worker.py"), str(tmp_path / "config.json"), str(tmp_path),
         "resume"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (done.stdout + done.stderr).count("nats: resuming from") == 1
    results = [json.loads((tmp_path / f"result{r}.json").read_text()) for r in (0, 1)]
    assert [r["step"] for r in results] == [stopped + 2] * 2


def test_a_gpu_index_beyond_those_visible_is_a_one_line_error(monkeypatch) -> None:
    """``--device cuda:3`` on a one-GPU machine was torch's 'invalid device ordinal'
    traceback when the first tensor moved there."""
    from nats.trainers.distributed import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device("cuda:0") == torch.device("cuda:0")
    assert resolve_device("cuda") == torch.device("cuda")
    with pytest.raises(ValueError, match=r"^device 'cuda:3' is invalid: this process sees 1 "
                                         r"GPU\(s\), cuda:0 \.\. cuda:0$"):
        resolve_device("cuda:3")
