"""On a CUDA GPU: the model on the Triton kernels equals the model on the references."""

import pytest
import torch

from nats import NatsConfig, NatsForCausalLM

from .models import rel_err

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize(("chunk_size", "dtype"), [(64, torch.float32), (128, torch.bfloat16)],
                         ids=["c64-fp32", "c128-bf16"])
def test_triton_backend_matches_reference_forward_and_gradients(chunk_size, dtype):
    cfg = NatsConfig(vocab_size=512, d_model=256, n_layers=2, n_heads=4, softmax_heads_per_head=2,
                     head_dim_k=64, head_dim_v=64, chunk_size=chunk_size,
                     layer_types=("nats", "gdn"), backend="reference")
    torch.manual_seed(0)
    reference = NatsForCausalLM(cfg).cuda()
    with torch.no_grad():  # spread the scorer so that both routes occur
        for layer in reference.nats_layers:
            layer.scorer.proj.weight.normal_(0, 0.5)
    fast = NatsForCausalLM(cfg.replace(backend="triton")).cuda()
    fast.load_state_dict(reference.state_dict())
    ids = torch.randint(0, 512, (2, 1000), device="cuda")
    results = []
    for model in (reference, fast):
        with torch.autocast("cuda", dtype=dtype, enabled=dtype != torch.float32):
            out = model(ids, labels=ids)
        out.loss.backward()
        results.append((out, {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_out, ref_grads), (fast_out, fast_grads) = results
    assert torch.equal(ref_out.routes[0], fast_out.routes[0])
    tol = 5e-3 if dtype == torch.float32 else 2e-2
    assert rel_err(fast_out.logits.float(), ref_out.logits.float()) < tol
    for name, grad in ref_grads.items():
        assert rel_err(fast_grads[name], grad) < 2 * tol, name
