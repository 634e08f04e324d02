"""The NAtS-L supernet layer (NATSL.md): shared projections, a chunk scorer, both branches.

Each finished chunk is routed, per routing head, to softmax attention (its keys stay
in the KV cache) or to the linear operator (``linear_op``, the gated delta rule by
default; the chunk is folded into its state); every query
sees its own chunk through both. The two branch outputs are merged per token and
softmax head by learned weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from nats.cache import NatsLayerCache
from nats.config import NatsConfig
from nats.kernels import (
    SOFTMAX,
    chunk_routes,
    hybrid_softmax_attention,
    merge_branches,
    qk_norms,
)
from nats.kernels.decode import (
    AttentionSplits,
    append_to_open_chunk,
    hybrid_attention_decode,
    hybrid_attention_splits,
    merge_step,
)
from nats.kernels.reference.routes import ChunkRoutes
from nats.kernels.streams import concurrently

from .linear_ops import QK_NORM_EPS, LinearOperator, TokenGates
from .norms import RMSNorm, upcast
from .projections import GatedOutput, QKVProjection
from .rotary import apply_rotary
from .routing import (
    BudgetedScores,
    ChunkScorer,
    RouteOverride,
    RunningMoments,
    check_override_covers,
    chunk_pool,
    forced_routes,
    pooled_width,
    sampling_noise,
    scorer_input,
)


@dataclass
class LayerRouting:
    """What one forward of a NAtS-L layer decided.

    ``routes`` ``[B, N, H, 2]`` (one-hot, straight-through), ``probs`` the scorer's
    probabilities, ``attn_frac`` ``[H]`` the softmax fraction per head
    (:func:`nats.softmax_fraction.softmax_fraction`: token-weighted), ``reg`` the cost
    regulariser ``lambda * mean(probs[..., softmax])`` and ``routable_frac`` the share of
    routable chunks sent to softmax (what a budget holds); both leave out each sequence's
    last chunk, whose route no query sees (NaN in ``routable_frac`` when a sequence is one
    chunk).
    """

    routes: torch.Tensor
    probs: torch.Tensor
    attn_frac: torch.Tensor
    reg: torch.Tensor
    routable_frac: torch.Tensor


class NatsAttention(nn.Module):
    """Token-level hybrid attention with learned chunk routing."""

    def __init__(self, cfg: NatsConfig) -> None:
        super().__init__()
        self.cfg = cfg
        h, r = cfg.n_heads, cfg.softmax_heads_per_head
        dims = (h * cfg.head_dim_k, h * cfg.head_dim_k, h * cfg.head_dim_v)
        # Under softmax_qkv="own" one projection makes both branches' q/k/v: the softmax
        # branch's columns get no gradient from the linear branch, and decoding keeps one
        # convolution window.
        self.qkv = QKVProjection(cfg.d_model, dims * (2 if cfg.softmax_qkv == "own" else 1),
                                 cfg.conv_size, cfg.backend)
        self.q_norm = RMSNorm(cfg.softmax_head_dim_k, cfg.norm_eps, cfg.backend)
        self.k_norm = RMSNorm(cfg.softmax_head_dim_k, cfg.norm_eps, cfg.backend)
        self.linear = LinearOperator.from_config(cfg)
        self.gates = self.linear.gates(cfg.d_model)
        self.scorer = ChunkScorer(pooled_width(cfg.d_model, cfg.scorer_pool), h,
                                  norm=cfg.scorer_norm, detach=cfg.scorer_detach,
                                  backend=cfg.backend)
        if cfg.softmax_target is not None:
            self.budget = BudgetedScores(h, cfg.softmax_target, backend=cfg.backend)
        self.mix = nn.Linear(h * cfg.head_dim_k, 2 * h * r, bias=False)
        self.out = GatedOutput(cfg.d_model, h * r, cfg.softmax_head_dim_v, cfg.output_gate)
        self.softmax_gamma: nn.Parameter | None = None
        """Under ``branch_gamma``: the softmax branch's own weight in the merge (``out.gamma``
        is then the linear branch's)."""
        if cfg.branch_gamma:
            self.softmax_gamma = nn.Parameter(torch.ones(cfg.softmax_head_dim_v))
        self.softmax_scale: RunningMoments | None = None
        """Under ``branch_norm="scaled"``: the running mean square of each softmax head's
        output (``running_mean``; 1 until the first training step)."""
        if cfg.branch_norm == "scaled":
            self.softmax_scale = RunningMoments(h * r, warm_start=True, backend=cfg.backend)
            self.softmax_scale.running_mean.fill_(1.0)
        self.softmax_gain: nn.Parameter | None = None
        """Under ``softmax_gain_init``: each softmax head's learned weight in the merge."""
        if cfg.softmax_gain_init is not None:
            self.softmax_gain = nn.Parameter(torch.full((h * r,), float(cfg.softmax_gain_init)))
        self.route_override: RouteOverride = None
        self.route_noise = 0.0
        """Scale of the Gumbel noise on the routing logits while training (exploration;
        set by the trainer's schedule)."""

    # -- pieces shared by the parallel form and decoding ---------------------------------

    def _softmax_heads(self, qkv: tuple[torch.Tensor, ...], start: int | torch.Tensor):
        """The softmax heads' normalised, rotated q, k and v from the projection's output
        (its last three parts: the shared ones, or the softmax branch's own)."""
        cfg = self.cfg
        q, k, v = qkv[-3:]
        shape = (*q.shape[:2], cfg.n_heads * cfg.softmax_heads_per_head, -1)
        qs, ks = self._rotated(self.q_norm(q.view(shape)), self.k_norm(k.view(shape)), start)
        return qs, ks, v.view(shape)

    def _rotated(self, qs: torch.Tensor, ks: torch.Tensor, start: int | torch.Tensor,
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The softmax heads' normalised q and k, rotated from position ``start`` under
        ``rope``."""
        if not self.cfg.rope:
            return qs, ks
        return (apply_rotary(qs, start, self.cfg.rope_theta),
                apply_rotary(ks, start, self.cfg.rope_theta))

    def _shares_qk_norms(self) -> bool:
        """Whether one kernel may make both branches' norms of q and k: the softmax heads
        read the shared q and k (a study that feeds them from elsewhere says False) and
        the linear operator takes them as unit vectors."""
        return self.cfg.softmax_qkv == "shared" and self.linear.unit_qk

    def _branch_heads(self, qkv: tuple[torch.Tensor, ...], start: int | torch.Tensor,
                      ) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(qs, ks, vs), (ql, kl, vl)``: both branches' heads (:meth:`_softmax_heads`,
        ``linear.features``), the norms of the shared q and k taken by one kernel
        where :meth:`_shares_qk_norms` (one read of q and of k, one launch each way)."""
        if not self._shares_qk_norms():
            return self._softmax_heads(qkv, start), self.linear.features(*qkv[:3])
        cfg = self.cfg
        q, k, v = qkv[:3]
        heads = (*q.shape[:2], cfg.n_heads, -1)
        r = cfg.softmax_heads_per_head
        qs, ql, ks, kl = qk_norms(q.view(heads), k.view(heads), self.q_norm.weight,
                                  self.k_norm.weight, r, self.q_norm.eps, self.k_norm.eps,
                                  QK_NORM_EPS, backend=cfg.backend)
        qs, ks = self._rotated(qs, ks, start)
        return (qs, ks, v.view(*q.shape[:2], cfg.n_heads * r, -1)), (ql, kl, v.view(heads))

    def _route(self, pooled: torch.Tensor, first_chunk: int | torch.Tensor, seq_len: int,
               ) -> ChunkRoutes:
        """Routes of chunks ``first_chunk ..`` of ``seq_len`` tokens from their pooled
        inputs, with the scorer's probabilities and the pass's statistics (``first_chunk``
        a device scalar or an int: :func:`forced_routes`)."""
        cfg = self.cfg
        logits = self.scorer(pooled)
        budget = None if cfg.softmax_target is None else \
            self.budget.state(self.training, logits.device)
        forced = noise = tau = None
        if self.route_override is None:
            noise, tau = sampling_noise(logits, cfg.sampler, cfg.gumbel_tau, self.training,
                                        noise=self.route_noise)
        else:
            forced = forced_routes(self.route_override, pooled.shape[0], first_chunk,
                                   pooled.shape[1], cfg.n_heads, pooled.device)
        return chunk_routes(logits, seq_len, cfg.chunk_size, budget=budget, forced=forced,
                            noise=noise, tau=tau, backend=cfg.backend)

    @property
    def _merges_splits(self) -> bool:
        """Whether a decode step's merge takes the softmax branch as its attention's splits,
        and the mix projection, in its own launch: where the weights are the logits' plain
        softmax (no scale or gain on the softmax branch, one gamma)."""
        return self.softmax_scale is None and self.softmax_gain is None \
            and self.softmax_gamma is None

    def _merge(self, q: torch.Tensor, o_la: torch.Tensor,
               o_sm: torch.Tensor | AttentionSplits, x: torch.Tensor) -> torch.Tensor:
        """``(w_LA RMSNorm(o_LA) + w_SM RMSNorm(o_SM)) * gamma * SiLU(W_g x)``, then ``W_o``;
        ``NatsConfig.branch_norm`` says which of the two RMSNorms apply (``scaled``: the
        softmax one becomes a division by the head's running RMS, folded into ``w_SM``, as
        is the learned gain of ``softmax_gain_init``). ``o_sm`` is a decode step's
        attention splits where :attr:`_merges_splits` (one token, no gradients)."""
        cfg = self.cfg
        heads = cfg.n_heads * cfg.softmax_heads_per_head
        norms = dict(norm_a=cfg.branch_norm != "none", norm_b=cfg.branch_norm == "both",
                     out_dtype=x.dtype, backend=cfg.backend)
        if isinstance(o_sm, AttentionSplits):
            o_la = o_la.reshape(*o_sm.acc.shape[:2], -1)
            y = merge_step(q[:, 0], self.mix.weight, o_la, o_sm, self.out.gamma, cfg.norm_eps,
                           **norms)[:, None]
            return self.out.project(y, x)
        o_la = o_la.reshape(*o_sm.shape)
        scale = None  # of the softmax branch, folded into w_SM so the merge kernel is one
        if self.softmax_scale is not None:
            if self.training:
                self.softmax_scale.accumulate(upcast(o_sm).square().mean(-1).reshape(-1, heads))
            scale = torch.rsqrt(self.softmax_scale.running_mean + cfg.norm_eps)
        if self.softmax_gain is not None:
            scale = self.softmax_gain if scale is None else scale * self.softmax_gain
        w = self.mix(q).view(*q.shape[:2], heads, 2)  # logits
        if scale is not None:  # the weights themselves, scaled; else the merge takes logits
            w = F.softmax(upcast(w), -1) * torch.stack([torch.ones_like(scale), scale], -1)
        y = merge_branches(o_la, o_sm, w, self.out.gamma, cfg.norm_eps, **norms,
                           gamma_b=self.softmax_gamma, logits=scale is None)
        return self.out.project(y, x)

    # -- parallel form ---------------------------------------------------------------------

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, LayerRouting]:
        y, routing, _ = self._parallel(x, self.qkv(x), cache_conv=None)
        return y, routing

    def prefill(self, x: torch.Tensor,
                ) -> tuple[torch.Tensor, LayerRouting, Callable[[], NatsLayerCache]]:
        """Like forward, plus the cache after ``x`` as a finisher to call once the next
        layer's work is queued: the key/value store is sized by the most softmax chunks of
        any head, a number that must reach the host, and waiting for it at once would idle
        the GPU while the host catches up (:meth:`NatsForCausalLM.prefill`)."""
        qkv, conv = self.qkv.prefill(x)
        return self._parallel(x, qkv, cache_conv=conv)

    def _parallel(self, x: torch.Tensor, qkv: tuple[torch.Tensor, ...],
                  cache_conv: torch.Tensor | None):
        cfg, c = self.cfg, self.cfg.chunk_size
        seq_len = x.shape[1]
        q = qkv[0]
        decided = self._route(chunk_pool(x, c, cfg.scorer_pool), 0, seq_len)
        routes = decided.routes
        (qs, ks, vs), (ql, kl, vl) = self._branch_heads(qkv, 0)
        gates = self.gates(x)
        linear = self.linear.parallel if cache_conv is None else self._prefill_linear
        o_sm, linear_out = concurrently(
            lambda: hybrid_softmax_attention(qs, ks, vs, routes, c, route_grad=cfg.route_grad,
                                             backend=cfg.backend),
            lambda: linear(ql, kl, vl, gates, routes), x.device)
        if cache_conv is None:
            o_la, cache = linear_out[0], None
        else:
            o_la, state, snapshot = linear_out
            done = seq_len // c * c  # tokens in finished chunks
            store = self._pack_store(ks, vs, routes, done // c)
            parts = dict(
                conv=cache_conv, state=state.contiguous(),
                snapshot=snapshot.to(state.dtype, copy=True),
                chunk_log_decay=gates.g[:, done:].sum(1), chunk_k=self._open_chunk(ks, done),
                chunk_v=self._open_chunk(vs, done), open_len=seq_len - done,
                pool_sum=upcast(x[:, done:]).sum(1), pool_max=self._open_max(x, done))

            def cache(own: bool = False) -> NatsLayerCache:
                # The packed store and its length are new tensors; the parts are not.
                store_k, store_v, store_chunks, most = store()
                made = NatsLayerCache(**parts, store_k=store_k, store_v=store_v,
                                      store_len=store_chunks * c, most_filed=most)
                return made.cloned(parts) if own else made
        routing = LayerRouting(routes=routes, probs=decided.probs, attn_frac=decided.attn_frac,
                               reg=cfg.reg_lambda * decided.reg,
                               routable_frac=decided.routable_frac)
        return self._merge(q, o_la, o_sm, x), routing, cache

    # -- prefill: the cache after a prompt -------------------------------------------------

    def _prefill_linear(self, q, k, v, gates: TokenGates, routes: torch.Tensor):
        """Linear branch split at the last chunk boundary: ``(o, state, snapshot)``.

        Complete chunks run with their routes; the unfinished tail runs on from their
        final state (the snapshot) as if it wrote: its route is known only once it ends.
        """
        c = self.cfg.chunk_size
        seq_len = q.shape[1]
        split = seq_len // c * c
        snapshot = self.linear.initial_state(q.shape[0], q.device)
        outs = []
        if split:
            head = slice(0, split)
            o, snapshot = self.linear.parallel(
                q[:, head], k[:, head], v[:, head], gates.window(head), routes[:, : split // c],
                initial_state=snapshot, output_final_state=True)
            outs.append(o)
        state = snapshot
        if split < seq_len:
            tail = slice(split, seq_len)
            o, state = self.linear.parallel(q[:, tail], k[:, tail], v[:, tail],
                                            gates.window(tail), initial_state=snapshot,
                                            output_final_state=True)
            outs.append(o)
        return torch.cat(outs, 1), state, snapshot

    def _open_chunk(self, x: torch.Tensor, done: int) -> torch.Tensor:
        """The unfinished chunk's tokens ``x[:, done:]`` in a ``[B, H*r, C, D]`` buffer."""
        tail = x[:, done:].transpose(1, 2)
        return F.pad(tail, (0, 0, 0, self.cfg.chunk_size - tail.shape[2]))

    def _open_max(self, x: torch.Tensor, done: int) -> torch.Tensor:
        """The scorer's running maximum over the unfinished chunk ``x[:, done:]`` (``-inf``
        while it is empty, and always under the mean pool, which never reads it)."""
        if done == x.shape[1] or self.cfg.scorer_pool == "mean":
            return upcast(x[:, 0]).new_full((x.shape[0], x.shape[2]), -math.inf)
        return upcast(x[:, done:]).amax(1)

    def _pack_store(self, ks: torch.Tensor, vs: torch.Tensor, routes: torch.Tensor, done: int,
                    ) -> Callable[[], tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]]:
        """Keys/values of the ``done`` finished softmax chunks, packed in order per head,
        from a finisher: ``store_k, store_v`` ``[B, H, r, M, C, D]``, the real slot counts
        ``[B, H]`` and their maximum; slots past a head's count hold stale data that
        decoding never reads. The finisher waits only for the store's size (the most
        softmax chunks of any head, copied to the host without blocking), not for work
        queued after it. While a CUDA graph captures the prefill the size stays on the
        device, and the finisher, called after a replay, reads it there
        (:class:`nats.cuda_graph.GraphedPrefill`).
        As the softmax layer's cache, the store keeps room for a quarter more chunks: full,
        the first chunk closed after the prompt would move it, and a graphed decoder would
        capture its step again.
        """
        c, h, r = self.cfg.chunk_size, self.cfg.n_heads, self.cfg.softmax_heads_per_head
        batch = ks.shape[0]
        if done == 0:  # a new empty store at each call, as a packed one is
            kind = dict(dtype=ks.dtype, device=ks.device)
            dk, dv = ks.shape[-1], vs.shape[-1]
            return lambda: (torch.zeros(batch, h, r, 1, c, dk, **kind),
                            torch.zeros(batch, h, r, 1, c, dv, **kind),
                            torch.zeros(batch, h, dtype=torch.long, device=ks.device), 0)
        is_sm = routes[:, :done, :, SOFTMAX] > 0.5  # [B, done, H]
        counts = is_sm.sum(1)
        # Softmax chunks first, each group in chunk order: a stable sort on "is linear".
        order = torch.sort((~is_sm).int(), dim=1, stable=True).indices
        most = counts.max()
        copied = None
        if most.is_cuda and not torch.cuda.is_current_stream_capturing():
            most = most.to("cpu", non_blocking=True)
            copied = torch.cuda.Event() if most.is_pinned() else None
            if copied is not None:
                copied.record()

        # The finished chunks [B, H, done, C, r, D] and their order per head, as views made
        # now: the finisher's host work is only what needs the size (after a graph's
        # replay, all of it is on the host's clock).
        at = order.permute(0, 2, 1)[..., None, None, None]
        finished = [t[:, : done * c].reshape(batch, done, c, h, r, t.shape[-1])
                    .permute(0, 3, 1, 2, 4, 5) for t in (ks, vs)]

        def pack(chunks: torch.Tensor, filled: int) -> torch.Tensor:
            # Gathered straight into the store with its room: one copy of the keys.
            d = chunks.shape[-1]
            packed = chunks.new_empty(batch, h, r, filled + max(1, filled // 4), c, d)
            torch.gather(chunks, 2, at[:, :, :filled].expand(-1, -1, -1, c, r, d),
                         out=packed[:, :, :, :filled].permute(0, 1, 3, 4, 2, 5))
            packed[:, :, :, filled:].zero_()
            return packed

        def finish() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
            if copied is not None:
                copied.synchronize()
            filed = int(most)  # one read: on the device after a replay, each is a wait
            filled = max(filed, 1)
            store_k, store_v = (pack(chunks, filled) for chunks in finished)
            return store_k, store_v, counts, filed

        return finish

    # -- decoding one token ----------------------------------------------------------------

    def step(self, x: torch.Tensor, cache: NatsLayerCache, position: torch.Tensor,
             ) -> torch.Tensor:
        """One token ``x`` ``[B, 1, D]`` at ``position`` (a device scalar); updates ``cache``
        in place without host reads. The token that ends a chunk also scores and files it
        (``cache.ends_chunk``); every other position launches the same kernels."""
        cfg = self.cfg
        qkv = self.qkv.step(x, cache.conv)
        q = qkv[0]
        (qs, ks, vs), (ql, kl, vl) = self._branch_heads(qkv, position)
        gates = self.gates.step(x[:, 0])
        o_la, _ = self.linear.step(cache.state, ql[:, 0], kl[:, 0], vl[:, 0], gates,
                                   out=cache.state)
        open_len = torch.empty(1, dtype=torch.long, device=x.device)  # written next
        append_to_open_chunk(position, ks[:, 0], vs[:, 0], x[:, 0], gates.g, cache.chunk_k,
                             cache.chunk_v, cache.pool_sum,
                             None if cfg.scorer_pool == "mean" else cache.pool_max,
                             cache.chunk_log_decay, open_len, backend=cfg.backend)
        store_k, store_v = cache.store_k.flatten(3, 4), cache.store_v.flatten(3, 4)
        over_cache = (qs[:, 0], store_k, store_v, cache.store_len, cache.chunk_k, cache.chunk_v,
                      open_len, cfg.softmax_head_dim_k**-0.5)
        o_sm = hybrid_attention_splits(*over_cache, backend=cfg.backend) \
            if self._merges_splits else hybrid_attention_decode(*over_cache,
                                                                backend=cfg.backend)[:, None]
        y = self._merge(q, o_la[:, None], o_sm, x)
        if cache.ends_chunk:
            self._close_chunk(cache, position)
        return y

    def closes_chunk(self, cache: NatsLayerCache, position: int) -> bool:
        """Whether the step of the token at ``position`` ends the open chunk, and so also
        scores and files it: the one thing on the host its launches depend on. Checks that
        a given routes tensor (``route_override``) covers that chunk, which a replayed step
        cannot."""
        if cache.ends_chunk and isinstance(self.route_override, torch.Tensor):
            check_override_covers(self.route_override, position // self.cfg.chunk_size + 1)
        return cache.ends_chunk

    def advance(self, cache: NatsLayerCache, position: int) -> None:
        """Host bookkeeping after the step of the token at ``position``."""
        cache.open_len += 1
        if cache.open_len == self.cfg.chunk_size:
            cache.chunk_closed()

    def _close_chunk(self, cache: NatsLayerCache, position: torch.Tensor) -> None:
        """Score the chunk that the token at ``position`` ends; SM keeps its keys and
        restores the snapshot decayed by the chunk's summed log gates (zero, so undecayed,
        for operators without a decay). Device work only: a graphed step replays it."""
        c = self.cfg.chunk_size
        pooled = scorer_input(cache.pool_sum / c, cache.pool_max,
                              self.cfg.scorer_pool).to(self.scorer.proj.weight.dtype)
        chunk = torch.div(position, c, rounding_mode="floor")
        routes = self._route(pooled[:, None], chunk, c).routes
        is_sm = routes[:, 0, :, SOFTMAX] > 0.5  # [B, H]
        decayed = cache.snapshot * cache.chunk_log_decay.exp()[..., None, None]
        cache.state.copy_(torch.where(is_sm[..., None, None], decayed, cache.state))
        cache.snapshot.copy_(cache.state)
        cache.file_chunk(is_sm)
        cache.pool_sum.zero_()
        if self.cfg.scorer_pool != "mean":
            cache.pool_max.fill_(-math.inf)
        cache.chunk_log_decay.zero_()
