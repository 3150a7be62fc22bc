"""Megatron-LM's example launch scripts, kept as data, run through the drop-in with only the prism flags added.

Each `Example` is one script of NVIDIA/Megatron-LM's ``examples/`` (`Example.source`: path and commit): the
arguments it passes to ``pretrain_gpt.py`` as the script builds them with its default settings, its path
arguments given paths that do not exist here (`Example.args`: ``{folder}`` is the run's folder), and what had to
be added (`Example.added`, with why). `run` launches one through ``python -m prism_plugin.megatron`` on a virtual
H100 (dgx-h100, the drop-in's default) as rank `Example.rank` of `Example.world_size`, for
``--prism-iterations K``, and returns when Megatron logged iteration 1 (and how long that took, measured) and the
rank's summary (modelled figures).

The world size is the script's own where it names one that fits its layout; GPT-3 175B's names 8 GPUs for a TP8 x
PP16 layout (128 at least), so it runs at 1024 (DP 8), as its 1536-sample batch suggests.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["EXAMPLES", "Example", "ExampleRun", "run"]

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True, kw_only=True, slots=True)
class Example:
    name: str
    source: str
    world_size: int
    rank: int
    args: tuple[str, ...]
    added: tuple[str, ...] = ()
    why_added: str = ""
    env: dict[str, str] = field(default_factory=dict)
    makes: tuple[str, ...] = ()
    """Folders the script creates before it launches (``mkdir -p``), under the run's folder."""
    prism: tuple[str, ...] = ()
    """Prism flags besides the world, the rank, the device and the iterations."""


EXAMPLES = {e.name: e for e in (
    Example(
        name="gpt3_175b",
        source="examples/gpt3/train_gpt3_175b_distributed.sh (NVIDIA/Megatron-LM 157006d6d9bf)",
        world_size=1024, rank=0, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        args=("--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
              "--max-position-embeddings", "2048", "--attention-backend", "auto",
              "--micro-batch-size", "1", "--global-batch-size", "1536", "--rampup-batch-size", "16", "16", "5859375",
              "--train-iters", "500000", "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95",
              "--init-method-std", "0.006", "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5",
              "--lr-decay-style", "cosine", "--min-lr", "6.0e-6", "--lr-warmup-fraction", ".001",
              "--lr-decay-iters", "430000",
              "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
              "--data-path", "/data/my-gpt3_00_text_document", "--vocab-file", "/data/gpt2-vocab.json",
              "--merge-file", "/data/gpt2-merges.txt", "--split", "949,50,1",
              "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
              "--save", "{folder}/ckpt", "--load", "{folder}/ckpt", "--eval-iters", "10",
              "--tensorboard-dir", "{folder}/tb"),
        added=("--tokenizer-type", "GPT2BPETokenizer"),
        why_added="megatron-core 0.19 builds no tokenizer without a type; the script predates that"),
    Example(
        name="llama3_8b_fp8",
        source="examples/llama/train_llama3_8b_h100_fp8.sh (NVIDIA/Megatron-LM 157006d6d9bf), MOCK data",
        world_size=8, rank=7, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"}, makes=("{folder}/cache",),
        prism=("--prism-oom", "report"),  # modelled: it does not fit an 80 GB H100 at TP1 CP1 (see the docs)
        args=("--use-mcore-models", "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
              "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
              "--kv-channels", "128", "--seq-length", "8192", "--max-position-embeddings", "8192",
              "--position-embedding-type", "rope", "--rotary-base", "1000000", "--rotary-percent", "1.0",
              "--attention-dropout", "0.0", "--hidden-dropout", "0.0", "--swiglu", "--init-method-std", "0.0134",
              "--attention-backend", "fused", "--apply-layernorm-1p", "--untie-embeddings-and-output-weights",
              "--disable-bias-linear",
              "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
              "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015",
              "--min-lr", "0.00001", "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5",
              "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
              "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16", "--cross-entropy-loss-fusion",
              "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
              "--exit-duration-in-mins", "235",
              "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
              "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
              "--fp8-param-gather",
              "--tensor-model-parallel-size", "1", "--context-parallel-size", "1", "--sequence-parallel",
              "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
              "--data-cache-path", "{folder}/cache", "--tiktoken-pattern", "v2", "--split", "'99,1,0'",
              "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
              "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
              "--log-throughput", "--profile", "--profile-step-start", "4", "--profile-step-end", "6",
              "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
              "--save", "{folder}/ckpt", "--load", "{folder}/ckpt", "--tensorboard-dir", "{folder}/tb")),
    Example(
        name="mixtral_8x7b",
        source="examples/mixtral/train_mixtral_8x7b_distributed.sh (NVIDIA/Megatron-LM 0a40979ee868)",
        world_size=2, rank=1, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"},
        args=("--use-mcore-models", "--disable-bias-linear", "--seq-length", "256", "--max-position-embeddings",
              "2048", "--num-layers", "2", "--hidden-size", "256", "--ffn-hidden-size", "896",
              "--num-attention-heads", "2", "--init-method-std", "0.01", "--attention-dropout", "0.0",
              "--hidden-dropout", "0.0", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
              "--swiglu", "--untie-embeddings-and-output-weights", "--group-query-attention",
              "--num-query-groups", "2", "--no-masked-softmax-fusion", "--no-position-embedding",
              "--rotary-base", "1000000",
              "--num-experts", "2", "--moe-router-topk", "2", "--moe-router-load-balancing-type", "aux_loss",
              "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall", "--overlap-param-gather",
              "--overlap-grad-reduce",
              "--tokenizer-type", "Llama2Tokenizer", "--tokenizer-model", "/workspace/Megatron-LM/tokenizer.model",
              "--mock-data", "--split", "99990,8,2",
              "--micro-batch-size", "1", "--global-batch-size", "4", "--lr", "1e-4", "--train-iters", "7",
              "--min-lr", "1.0e-5", "--weight-decay", "0.1", "--clip-grad", "1.0",
              "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
              "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--sequence-parallel",
              "--eval-iters", "10", "--no-load-optim", "--no-load-rng"),
        added=("--vocab-size", "32000", "--eval-interval", "1000"),
        why_added="the Llama-2 tokenizer model the script names is not on this host (its vocabulary is 32,000); the "
                  "script comments out --eval-interval 1000 but keeps --eval-iters 10, on which megatron-core 0.19 "
                  "stops before the first iteration (train_iters // eval_interval with None), on a GPU as here"),
)}


@dataclass(frozen=True, kw_only=True, slots=True)
class ExampleRun:
    exit_code: int | None
    wall_s: float
    startup_s: float | None
    """Wall seconds to Megatron's "before the start of training step" line (measured)."""
    first_iteration_s: float | None
    """Wall seconds to Megatron's iteration-1 log line (measured); None: none was logged."""
    summary: dict[str, Any]
    log_tail: str

    @property
    def step_times_s(self) -> list[float]:
        return list(self.summary.get("virtual_gpu", {}).get("virtual_time", {}).get("step_times_s") or [])

    @property
    def fast_forward(self) -> dict[str, Any]:
        """The summary's fast-forward figures (micro-batches skipped, periods advanced); empty when off."""
        return dict(self.summary.get("megatron", {}).get("fast_forward") or {})

    @property
    def peak_allocated_bytes(self) -> int | None:
        devices = self.summary.get("virtual_gpu", {}).get("devices") or [{}]
        return devices[0].get("peak_allocated_bytes")


def command(example: Example, folder: Path, iterations: int) -> list[str]:
    args = [a.format(folder=folder) for a in example.args]
    return [sys.executable, "-m", "prism_plugin.megatron", "prism_plugin/programs/pretrain_gpt.py", *args,
            *example.added, "--prism-world-size", str(example.world_size), "--prism-real-ranks", str(example.rank),
            "--prism-device", "virtual-gpu", "--prism-iterations", str(iterations), "--prism-output",
            str(folder / "out"), "--prism-timeline", "off", *example.prism]  # the timeline's writing: not timed


def run(example: Example, folder: Path, *, iterations: int = 1, timeout_s: float = 1200.0) -> ExampleRun:
    """Run `example` in `folder` until it ends (or `timeout_s`, then stopped)."""
    env = {**os.environ, **example.env}
    for made in example.makes:
        Path(made.format(folder=folder)).mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    marks: dict[str, float] = {}
    tail: list[str] = []
    proc = subprocess.Popen(command(example, folder, iterations), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.perf_counter() - start
        if "before the start of training step" in line:
            marks.setdefault("startup_s", now)
        if " iteration        1/" in line:
            marks.setdefault("first_iteration_s", now)
        tail = (tail + [line])[-80:]
        if now > timeout_s:
            proc.kill()
            break
    code = proc.wait()
    summaries = sorted((folder / "out").glob("rank*.summary.json"))
    return ExampleRun(exit_code=code, wall_s=time.perf_counter() - start, startup_s=marks.get("startup_s"),
                      first_iteration_s=marks.get("first_iteration_s"),
                      summary=json.loads(summaries[0].read_text()) if summaries else {}, log_tail="".join(tail))
