"""Clocks (docs/design.md §6). ``wall`` is real time. ``virtual`` charges every engine forward pass by a cost model so
that a cluster can be simulated deterministically on a small machine: the tokens, acceptance and decode steps
are real, only time is modelled.

A cost profile is a roofline: ``fixed + max(bytes moved / bandwidth, flops / peak) + sampling`` per forward pass,
where bytes are the weights plus the KV cache read, flops are the matrix products of every fed token plus
attention over every (query, context) pair, and sampling is a cost per sampled logit (rows x positions x
vocabulary), which makes wide verification at large vocabularies cost what it does.

A draft-head call that ran before a pass (``ForwardPass.head_steps`` > 0) is charged on the same device by the same
roofline over the whole call: a fixed cost per sequential step, then ``max(bytes, flops)`` where every step reads the
head's weights (its layer and the shared output head) and the flops are the head's per drafted token, per context
pair and per attended (query, key) pair, then the sampling of its logits.
"""

from __future__ import annotations

from dataclasses import dataclass

from bubblespec.core.interfaces import ForwardPass


@dataclass(frozen=True)
class CostProfile:
    name: str
    description: str
    fixed_s: float
    """Per forward pass: launch, scheduling and sampling overhead."""
    weight_bytes: float
    kv_bytes_per_context_token: float
    flops_per_token: float
    attention_flops_per_pair: float
    bandwidth_bytes_per_s: float
    flops_per_s: float
    train_flops_per_token: float
    """Forward + backward flops per trained token (about 3x the forward)."""
    train_fixed_s: float
    weight_sync_fixed_s: float
    """Per weight sync: the calls to the ranks."""
    weight_sync_put_bytes_per_s: float
    """The one copy of the weights into the object store (on GPUs: after the copy off the trainer's GPU)."""
    weight_sync_load_bytes_per_s: float
    """Each rank's load of the weights into its engine (across nodes: the node's copy over the network)."""
    weight_sync_parallel_ranks: int = 1
    """Ranks that load at once (one node's GPUs); the rest wait their turn."""
    sampling_s_per_logit: float = 0.0
    """Seconds per sampled logit (``ForwardPass.sampled_logits``): keyed sampling after the pass."""
    head_fixed_s: float = 0.0
    """Per draft-head step (``ForwardPass.head_steps``): launch overhead, its keyed sampling's included."""
    head_weight_bytes: float = 0.0
    """Bytes each draft-head step reads: the head's own parameters, the shared output head and final norm."""
    head_flops_per_token: float = 0.0
    """Per token a draft-head step computes (``ForwardPass.head_tokens``): fc, the layer's projections and MLP,
    the output head."""
    head_flops_per_context_pair: float = 0.0
    """Per context pair a draft-head call reads (``ForwardPass.head_context_pairs``): fc and the key/value
    projections."""
    head_attention_flops_per_pair: float = 0.0
    """Per (query, key) pair the head's steps attend (``ForwardPass.head_attention_pairs``)."""
    head_sync_bytes: float = 0.0
    """The bytes of a draft head's own parameters that a weight sync sends where the profile models a model
    (``weight_bytes``); 0: the head's actual bytes."""

    def forward_seconds(self, forward: ForwardPass) -> float:
        """A pass and the draft-head call that ran just before it (:meth:`head_seconds`)."""
        memory = (self.weight_bytes + self.kv_bytes_per_context_token * forward.context_tokens) / (
            self.bandwidth_bytes_per_s
        )
        compute = (
            self.flops_per_token * forward.num_tokens + self.attention_flops_per_pair * forward.attention_pairs
        ) / self.flops_per_s
        sampling = self.sampling_s_per_logit * forward.sampled_logits
        return self.fixed_s + max(memory, compute) + sampling + self.head_seconds(forward)

    def head_seconds(self, forward: ForwardPass) -> float:
        """The draft-head call of ``forward`` (0 without one): ``steps x head_fixed_s + max(steps x head weight
        bytes / bandwidth, head flops / peak) + sampling``, the head's flops those of its tokens, context pairs
        and attended pairs."""
        if forward.head_steps == 0:
            return 0.0
        memory = forward.head_steps * self.head_weight_bytes / self.bandwidth_bytes_per_s
        compute = (
            self.head_flops_per_token * forward.head_tokens
            + self.head_flops_per_context_pair * forward.head_context_pairs
            + self.head_attention_flops_per_pair * forward.head_attention_pairs
        ) / self.flops_per_s
        sampling = self.sampling_s_per_logit * forward.head_sampled_logits
        return forward.head_steps * self.head_fixed_s + max(memory, compute) + sampling

    def head_step_cost(self, window: int = 64, context_tokens: int = 1024) -> float:
        """One draft-head step of one row (``window`` pairs read and attended) over a decode pass of one row at
        ``context_tokens``: what a head token costs in passes (the head's sizing, ``models.draft_head.HeadSizing``).
        Sampling is left out of both (about the same logits)."""
        head = ForwardPass(1, 1, context_tokens, context_tokens, head_steps=1, head_tokens=1,
                           head_context_pairs=window - 1, head_attention_pairs=window)  # fmt: skip
        decode = ForwardPass(1, 1, context_tokens, context_tokens)
        return self.head_seconds(head) / self.forward_seconds(decode)

    def head_learning_seconds(self, trained_pairs: int, steps: int, window: int) -> float:
        """``steps`` AdamW steps of a draft head's online learning over ``trained_pairs`` pairs in all (the
        policy's passes that computed their hidden states are charged as forward passes): per pair three times a
        drafted token's flops (forward, and a backward of about twice that) with ``window`` keys attended, per step
        three head steps' fixed cost. Estimated from the drafting figures, not measured."""
        flops = 3 * (self.head_flops_per_token + window * self.head_attention_flops_per_pair) * trained_pairs
        return 3 * steps * self.head_fixed_s + flops / self.flops_per_s

    def train_seconds(self, num_tokens: int, num_workers: int) -> float:
        return self.train_fixed_s + self.train_flops_per_token * num_tokens / (self.flops_per_s * num_workers)

    def head_sync_seconds(self, num_bytes: float, num_ranks: int) -> float:
        """A learned draft head from its rank to ``num_ranks`` others with a weight sync: one put of its bytes
        (:attr:`head_sync_bytes` where the profile models a model, else ``num_bytes``), then each rank's load, as
        :meth:`weight_sync_seconds` moves weights (its calls are the sync's)."""
        if num_ranks < 1:
            return 0.0
        synced = self.head_sync_bytes or num_bytes
        rounds = -(-num_ranks // self.weight_sync_parallel_ranks)
        return synced / self.weight_sync_put_bytes_per_s + synced * rounds / self.weight_sync_load_bytes_per_s

    def weight_sync_seconds(self, num_bytes: float, num_ranks: int) -> float:
        """New weights to ``num_ranks`` ranks: one put of the bytes, then every rank's load, ``parallel_ranks``
        at a time. The bytes are those of the profile's model where it models one (``weight_bytes``), else
        ``num_bytes``, the weights actually sent."""
        synced = self.weight_bytes or num_bytes
        rounds = -(-num_ranks // self.weight_sync_parallel_ranks)
        return (
            self.weight_sync_fixed_s
            + synced / self.weight_sync_put_bytes_per_s
            + synced * rounds / self.weight_sync_load_bytes_per_s
        )


def _h100_7b() -> CostProfile:
    """A Qwen2.5-7B-shaped model (7.6e9 parameters, 28 layers, 4 KV heads of 128, hidden 3584) in bfloat16 on one
    H100 SXM (3.35 TB/s HBM, 989 TFLOP/s dense bf16), at 70% of peak bandwidth and 50% of peak flops. Keyed
    sampling runs as eager tensor operations that read and write 242 bytes per float32 logit (counted by
    ``python benchmarks/calibrate_cpu.py --sampling-only``), memory bound at the same 70% of bandwidth. A draft
    head of the same shape (``draft_head_size``; one decoder layer, the shared output head) reads 1.6 GB a step and
    computes 1.6 GFLOP per drafted token, so it is memory bound at small batches."""
    parameters, layers, kv_dim, hidden = 7.6e9, 28, 4 * 128, 3584
    bandwidth = 0.7 * 3.35e12
    return CostProfile(
        name="h100-7b",
        description=_h100_7b.__doc__.strip(),
        fixed_s=1.5e-3,
        weight_bytes=2 * parameters,
        kv_bytes_per_context_token=2 * layers * kv_dim * 2,  # keys and values, bf16
        flops_per_token=2 * parameters,
        attention_flops_per_pair=4 * layers * hidden,  # q.k and p.v per (query, context) pair
        bandwidth_bytes_per_s=bandwidth,
        flops_per_s=0.5 * 989e12,
        train_flops_per_token=6 * parameters,
        train_fixed_s=0.5,
        # Assumed, not measured: 25 GB/s off the trainer's GPU (PCIe 5) into the object store, then one copy per
        # node of 8 GPUs, whose ranks load it at once at 25 GB/s (the network at 50 GB/s is not the bottleneck).
        weight_sync_fixed_s=0.05,
        weight_sync_put_bytes_per_s=25e9,
        weight_sync_load_bytes_per_s=25e9,
        weight_sync_parallel_ranks=8,
        sampling_s_per_logit=242 / bandwidth,
        # Assumed, not measured: fixed_s spread over a pass's eager operations (about 1,180: 28 layers of 35, the
        # sampler's 175) and charged for a head step's 231 (operations counted on the CPU at this shape).
        head_fixed_s=3e-4,
        # draft_head_size(DecoderConfig of Qwen2.5-7B's shape) (tests/test_clocks.py checks them): 258,747,904
        # parameters of its own and the output head + final norm (152,064 x 3,584 + 3,584) in bf16; per token
        # layer_flops_per_token + output_head_flops_per_token; context_flops_per_pair; attention_flops_per_key.
        head_weight_bytes=2 * (258_747_904 + 545_000_960),
        head_flops_per_token=517_472_256 + 1_089_994_752,
        head_flops_per_context_pair=58_720_256,
        head_attention_flops_per_pair=14_336,
        head_sync_bytes=2 * 258_747_904,
    )


def _cpu_tiny() -> CostProfile:
    """The built-in torch engine on the shipped tiny model with one torch thread on a shared 2-core x86 machine,
    fitted to timed forward passes and training steps by ``python benchmarks/calibrate_cpu.py`` (median error of
    the forward fit 9% over 48 shapes). The CPU engine is overhead bound, so the profile is linear: a fixed cost
    per pass plus a cost per token and per attended (query, context) pair. Weight sync is fitted to
    ``python benchmarks/weight_sync.py`` (0.13 and 0.51 GB in bfloat16 to 1-8 Ray Serve ranks, median error 9%:
    0.08 s of calls, one put into the object store at 9.3 GB/s, each rank's load at 6.9 GB/s). Keyed sampling is
    fitted by ``python benchmarks/calibrate_cpu.py --sampling-only`` over 1-272 rows and vocabularies of
    19-151,936 (median error 11%; its per-call overhead of 0.66 ms is not in ``fixed_s``, which times the model's
    forward only). Draft-head calls are fitted by ``python benchmarks/calibrate_cpu.py --head`` (an untrained head
    over the shipped model, keyed sampling; 1-16 rows, 1-8 steps, 1-64 context pairs; CPU time, beside another
    benchmark on the same 2 cores, so noisy: six runs gave 5.5-6.5e-4 s a step, 0.73-1.2e-5 a token, 1.9-2.7e-6 a
    context pair, median errors 4.1-5.4% over 80 calls; the middle run's). A head step's fixed cost includes its
    sampler's overhead (a step whose tokens are all given skips the sampler: charged about 20% too much, checked
    by ``--head-check``); its attention is the forward fit's per pair over the model's 4 layers (too small at
    these windows to fit)."""
    return CostProfile(
        name="cpu-tiny",
        description=_cpu_tiny.__doc__.strip(),
        fixed_s=1.3e-3,
        weight_bytes=0.0,
        kv_bytes_per_context_token=0.0,
        flops_per_token=3.0e-5,  # seconds per fed token: with flops_per_s = 1 the "flops" are seconds
        attention_flops_per_pair=5.3e-8,
        bandwidth_bytes_per_s=1.0,
        flops_per_s=1.0,
        train_flops_per_token=5.8e-4,
        train_fixed_s=0.0,  # the fit's intercept was not distinguishable from zero
        weight_sync_fixed_s=0.08,
        weight_sync_put_bytes_per_s=9.3e9,
        weight_sync_load_bytes_per_s=6.9e9,
        sampling_s_per_logit=1.3e-8,
        head_fixed_s=5.5e-4,
        head_flops_per_token=8.6e-6,
        head_flops_per_context_pair=2.2e-6,
        head_attention_flops_per_pair=1.3e-8,
    )


PROFILES = {profile.name: profile for profile in (_h100_7b(), _cpu_tiny())}


class VirtualClock:
    """One rank's virtual time: advanced by each forward pass it runs (pass it as ``on_forward``)."""

    def __init__(self, profile: CostProfile, start: float = 0.0) -> None:
        self.profile = profile
        self.now = start
        self.forward_passes = 0
        self.head_seconds = 0.0
        """Of the time advanced, the draft-head calls' (:meth:`CostProfile.head_seconds`)."""

    def __call__(self, forward: ForwardPass) -> None:
        self.now += self.profile.forward_seconds(forward)
        self.forward_passes += 1
        self.head_seconds += self.profile.head_seconds(forward)


class DeadlineStop:
    """A stop signal that is set once ``timeline`` has reached ``deadline``: the virtual barrier."""

    def __init__(self, timeline: VirtualClock, deadline: float) -> None:
        self.timeline, self.deadline = timeline, deadline

    def is_set(self) -> bool:
        return self.timeline.now >= self.deadline
