"""On a CUDA GPU: bf16 training at the settings that once went to NaN stays finite; CUDA-graphed
training steps train as the eager ones."""

import copy
import math

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM
from nats.config import OFFICIAL_RECIPE
from nats.evaluation.model_bench import GRAPH_WARMUP_STEPS, training_step
from nats.trainers import TrainConfig, train

pytestmark = pytest.mark.gpu


def test_gated_deltanet_needle_run_stays_finite_in_bf16(tmp_path):
    """Gated DeltaNet on the needle task, 4 layers of width 128 at 1,024 bytes, lr 3e-3 and
    100 warm-up steps, as in the run that reached a NaN loss at step 139-277 (issue 19)
    while the CPU reference never did. The tf32 WY inverse let the state grow without bound
    once keys collapsed; the trainer raises on the first non-finite loss."""
    model = NatsConfig(vocab_size=266, d_model=128, n_layers=4, n_heads=2,
                       softmax_heads_per_head=2, head_dim_k=64, head_dim_v=64, chunk_size=64,
                       layer_types=("linear",) * 4, rope=True, **OFFICIAL_RECIPE)
    config = TrainConfig(model=model, task="needle", steps=250, batch_size=32, seq_len=1024,
                         needle_haystack="text", needle_distractors=1, lr=3e-3,
                         warmup_steps=100, precision="bf16", eval_interval=250,
                         log_interval=50, checkpoint_interval=1000, device="cuda",
                         cuda_graph=False, out_dir=str(tmp_path / "run"))
    result = train(config)
    assert all(math.isfinite(loss) for loss in result.train_losses)
    assert math.isfinite(result.eval_metrics["eval/loss"])


def test_routing_cost_term_stays_finite_in_bf16(tmp_path):
    """NAtS-L with the routing cost term (``reg_lambda`` 0.1, no budget), 2 layers of width
    128, chunk 64, 2,048 bytes, bf16, lr 1e-3: the settings of a run that went to a NaN
    loss within 1,000 steps on an H100 while the same model without the term stayed
    finite (issue 20). The first 400 steps cover the routes' early collapse, when the cost
    term dominates the scorers' gradient."""
    model = NatsConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=2,
                       softmax_heads_per_head=2, head_dim_k=64, head_dim_v=64, chunk_size=64,
                       layer_types=("nats", "nats"), reg_lambda=0.1, softmax_target=None)
    config = TrainConfig(model=model, task="text", steps=400, batch_size=8, seq_len=2048,
                         lr=1e-3, warmup_steps=50, grad_clip=1.0, precision="bf16",
                         eval_interval=400, log_interval=50, checkpoint_interval=1000,
                         device="cuda", cuda_graph=False, out_dir=str(tmp_path / "run"))
    result = train(config)
    assert all(math.isfinite(loss) for loss in result.train_losses)
    assert math.isfinite(result.eval_metrics["eval/loss"])


@pytest.mark.parametrize("layers, fraction, branch_norm", [
    (("softmax", "softmax"), None, "both"), (("linear", "linear"), None, "both"),
    (("nats", "nats"), 0.25, "both"), (("nats", "nats"), None, "both"),
    (("nats", "nats"), None, "scaled"), (("linear", "softmax"), None, "both")])
def test_a_graphed_training_step_trains_as_the_eager_one(layers, fraction, branch_norm):
    """The model benchmark's CUDA-graphed step (``nats bench model --cuda-graph``) against
    the eager step, on the same fixed batch from the same weights: every form, NAtS-L at a
    forced fraction and routing itself (scorer statistics, the budget's moments and, under
    ``scaled``, the warm-started softmax scale committed inside the graph; the branches on
    two streams). The losses of steps 4-6 agree with the eager ones and fall from replay to
    replay (a replay that skipped the update would not), and the committed statistics
    agree (a commit left out of the graph would not)."""
    config = NatsConfig(vocab_size=256, d_model=128, n_layers=2, n_heads=2,
                        softmax_heads_per_head=2, head_dim_k=64, head_dim_v=64, chunk_size=64,
                        layer_types=layers, branch_norm=branch_norm)
    torch.manual_seed(0)
    eager_model = NatsForCausalLM(config).cuda()
    eager_model.set_route_override(fraction)
    graphed_model = copy.deepcopy(eager_model)
    ids = torch.randint(0, 256, (4, 456), device="cuda")  # a last chunk cut short
    eager = training_step(eager_model, ids, lr=3e-3)
    eager_losses = [float(eager()) for _ in range(GRAPH_WARMUP_STEPS + 3)]
    graphed = training_step(graphed_model, ids, lr=3e-3, cuda_graph=True)
    graphed_losses = [float(graphed()) for _ in range(3)]
    assert graphed_losses == pytest.approx(eager_losses[GRAPH_WARMUP_STEPS:], abs=0.05)
    assert graphed_losses[-1] < graphed_losses[0] - 0.1
    for a, b in zip(eager_model.buffers(), graphed_model.buffers(), strict=True):
        assert torch.allclose(a.float(), b.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize(("grad_accum_steps", "precision", "tol"),
                         [(1, "fp32", 0.02), (2, "fp32", 0.02), (1, "bf16", 0.05)])
def test_nats_train_with_cuda_graph_trains_as_the_eager_run(tmp_path, monkeypatch,
                                                            grad_accum_steps, precision, tol):
    """``nats train`` on a GPU (steps from a CUDA graph by default) against the same run
    eager (``--no-cuda-graph``): all-NAtS-L under the budget
    (its biases moved on the host between replays), the cost term switched on mid-run
    (``reg_start``: its weight enters the graph as a tensor; at ``reg_lambda`` 1 a graph
    that kept weight 0 would miss the loss by ~0.2), MQAR batches whose labelled-token
    counts differ, one or two micro-batches, fp32 and bf16 autocast (the precision the
    GPU runs train in). Every step after the second must be a replay, and the losses, the
    budget's biases and the committed statistics agree with the eager run's."""
    replays = []
    replay = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay",
                        lambda graph: (replays.append(1), replay(graph))[1])
    model = NatsConfig(vocab_size=512, d_model=128, n_layers=2, n_heads=2,
                       softmax_heads_per_head=2, head_dim_k=64, head_dim_v=64, chunk_size=64,
                       layer_types=("nats", "nats"), reg_lambda=1.0, branch_norm="scaled")
    config = TrainConfig(model=model, task="mqar", steps=16, batch_size=8, seq_len=320,
                         mqar_pairs=16, lr=3e-3, warmup_steps=2, reg_start=0.5,
                         grad_accum_steps=grad_accum_steps, precision=precision,
                         eval_interval=8, log_interval=1, checkpoint_interval=100,
                         device="cuda")
    eager = train(config.replace(out_dir=str(tmp_path / "eager"), cuda_graph=False))
    eager_replays = len(replays)
    graphed = train(config.replace(out_dir=str(tmp_path / "graphed")))
    assert eager_replays == 0 and len(replays) == config.steps - 2
    assert graphed.train_losses == pytest.approx(eager.train_losses, abs=1.5 * tol)
    jump = eager.train_losses[8] - eager.train_losses[7]
    assert jump > 0.1  # the cost term's switch is in the losses compared
    assert graphed.eval_metrics["eval/loss"] == pytest.approx(eager.eval_metrics["eval/loss"],
                                                              abs=1.5 * tol)
    for (name, a), (_, b) in zip(eager.model.named_buffers(), graphed.model.named_buffers(),
                                 strict=True):
        torch.testing.assert_close(b.float(), a.float(), atol=tol, rtol=tol, msg=name)
