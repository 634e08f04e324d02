"""On a CUDA GPU: bf16 training at the settings that once went to NaN stays finite."""

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
                         out_dir=str(tmp_path / "run"))
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
                         device="cuda", out_dir=str(tmp_path / "run"))
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
