"""The training loop: AdamW with a warm-up / stable / decay (or cosine) schedule, clipping,
checkpoints, exact resume, and the exact simulated-acceptance evaluation.

Determinism: the rows of step s depend only on (seed, s) (`AnchorSampler`) and initialisation
only on the seed, so a run resumed from a checkpoint (weights, optimizer state, step) continues
exactly like an uninterrupted one. With the WSD schedule the learning rate before the decay does
not depend on `steps`, so a run can be extended by resuming it with more steps. Checkpoints are
written to a temporary directory and renamed into place; the drafter inside is in the published
layout.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from ..drafter.config import parse_config
from ..drafter.load import build_drafter, read_checkpoint, save_drafter
from ..paths import atomic_path
from . import tied
from .dataset import AnchorSampler, FeatureDataset
from .evaluate import simulate
from .loss import Batch, LossWeights, TrainVocab, drafter_loss, estimated_tau, position_weights


@dataclass
class TrainConfig:
    steps: int = 1000
    seqs_per_batch: int = 8
    anchors_per_seq: int = 16
    lr: float = 6e-4
    schedule: str = "wsd"  # "wsd" (warm-up, stable, linear decay over decay_frac) or "cosine"
    warmup_frac: float = 0.04
    decay_frac: float = 0.2
    min_lr_frac: float = 0.1
    weight_decay: float = 0.01
    grad_clip: float = 1.0
    gamma: float | None = None
    dpace: bool = False  # position weights from each block's own chance of reaching a position
    selector_weight: float = 1.0
    selector_tv_weight: float = 0.0
    ce_weight: float = 1.0
    kl_weight: float = 0.0
    # Loss weights move linearly from the values above to these (None: unchanged) over ramp_frac.
    ce_weight_end: float | None = None
    selector_weight_end: float | None = None
    selector_tv_weight_end: float | None = None
    kl_weight_end: float | None = None
    ramp_frac: float = 0.5
    inject_gold: bool = False
    block_size: int | None = None  # train at this block size (default: the drafter's)
    train_vocab: int = 0  # train over the N most frequent ids of the drafter's proposal vocab; 0: all
    seed: int = 0
    eval_every: int = 100
    eval_blocks: tuple[int, ...] = (4, 8)
    save_every: int = 100
    freeze_backbone: bool = False
    tie_codebooks: bool = False  # DFlash 2: selector codebooks = E·P + R while training (`tied.py`)

    def loss_weights(self, step: int) -> LossWeights:
        """The loss weights at `step` (the ramp from the start values to the end values)."""
        f = min(1.0, step / max(1.0, self.ramp_frac * self.steps))

        def at(start: float, end: float | None) -> float:
            return start if end is None else start + (end - start) * f

        return LossWeights(at(self.ce_weight, self.ce_weight_end), at(self.selector_weight, self.selector_weight_end),
                           at(self.selector_tv_weight, self.selector_tv_weight_end),
                           at(self.kl_weight, self.kl_weight_end))


def lr_schedule(cfg: TrainConfig):
    warm = max(1, int(cfg.steps * cfg.warmup_frac))
    if cfg.schedule == "cosine":
        decay = optim.cosine_decay(cfg.lr, max(1, cfg.steps - warm), cfg.lr * cfg.min_lr_frac)
        return optim.join_schedules([optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm), decay], [warm])
    if cfg.schedule != "wsd":
        raise ValueError(f"schedule must be 'wsd' or 'cosine', got {cfg.schedule!r}")
    decay_at = max(warm, cfg.steps - int(cfg.steps * cfg.decay_frac))
    parts = [optim.linear_schedule(cfg.lr * 0.01, cfg.lr, warm),
             optim.linear_schedule(cfg.lr, cfg.lr, max(1, decay_at - warm)),
             optim.linear_schedule(cfg.lr, cfg.lr * cfg.min_lr_frac, max(1, cfg.steps - decay_at))]
    return optim.join_schedules(parts, [warm, decay_at])


@dataclass
class TrainState:
    step: int = 0
    history: list = field(default_factory=list)


class Trainer:
    """Owns the drafter, optimizer, data and checkpoints of one training run."""

    def __init__(self, drafter, parts, data: FeatureDataset, cfg: TrainConfig, out_dir: Path,
                 eval_data: FeatureDataset | None = None, vocab: TrainVocab | None = None,
                 eval_groups: dict[int, str] | None = None):
        self.drafter, self.data, self.eval_data, self.cfg = drafter, data, eval_data, cfg
        self.eval_groups = eval_groups
        self.out_dir = Path(out_dir)
        drafter.target = parts
        if cfg.freeze_backbone:
            if not drafter.config.is_v2:
                raise ValueError("freeze_backbone trains only the DFlash 2 convs and selector; the drafter is v1")
            drafter.freeze()
            for layer in drafter.layers:
                layer.attention_conv.unfreeze()
                layer.mlp_conv.unfreeze()
            drafter.candidate_selector.unfreeze()
        if cfg.tie_codebooks:
            if not drafter.config.is_v2:
                raise ValueError("tie_codebooks ties the DFlash 2 selector's codebooks; the drafter is v1")
            tied.tie(drafter.candidate_selector, parts.embed_weight)
        self.block_size = cfg.block_size or drafter.config.block_size
        self.weights = position_weights(self.block_size, cfg.gamma)
        self.sampler = AnchorSampler(data, cfg.seqs_per_batch, cfg.anchors_per_seq, cfg.seed)
        self.soft = bool(cfg.kl_weight or cfg.kl_weight_end)
        if self.soft and not data.top_k:
            raise ValueError("kl_weight needs soft labels (top-k log-probs) in the data; these shards have none")
        self.vocab = vocab
        self.head = None if vocab is None else vocab.head(parts)
        if self.head is not None:
            mx.eval(self.head)
        self.optimizer = optim.AdamW(learning_rate=lr_schedule(cfg), weight_decay=cfg.weight_decay)
        self.optimizer.init(drafter.trainable_parameters())
        self.state = TrainState()
        self._grad = nn.value_and_grad(drafter, self._loss)

    def _loss(self, batch: Batch, loss_weights: LossWeights | None = None):
        loss_weights = loss_weights or self.cfg.loss_weights(self.state.step)
        return drafter_loss(self.drafter, batch, self.weights, loss_weights, self.vocab, self.head,
                            block_size=self.block_size, dpace=self.cfg.dpace, inject_gold=self.cfg.inject_gold)

    def make_batch(self, step: int) -> Batch:
        return self.data.batch(self.sampler.rows(step), self.block_size, self.cfg.anchors_per_seq, self.soft)

    def step(self) -> dict:
        batch = self.make_batch(self.state.step)
        loss_weights = self.cfg.loss_weights(self.state.step)
        (loss, metrics), grads = self._grad(batch, loss_weights)
        grads, norm = optim.clip_grad_norm(grads, self.cfg.grad_clip)
        self.optimizer.update(self.drafter, grads)
        mx.eval(self.drafter.parameters(), self.optimizer.state, metrics, norm)
        self.state.step += 1
        return _to_python(metrics) | {"grad_norm": norm.item(), "lr": float(self.optimizer.learning_rate.item())}

    def evaluate(self) -> dict:
        """Exact simulated acceptance on every anchor of the evaluation data (`evaluate.simulate`)."""
        if self.eval_data is None:
            return {}
        result = simulate(self.drafter, self.eval_data, self.cfg.eval_blocks, self.vocab, self.head,
                          self.cfg.anchors_per_seq, self.cfg.seqs_per_batch, self.eval_groups)
        return {f"eval_{b}_{k}": v for b, r in result.items() for k, v in r.items()}

    # -- checkpoints ------------------------------------------------------------------

    def save(self, final: bool = False) -> Path:
        dest = self.out_dir / "checkpoint"
        with atomic_path(dest) as tmp:
            self._save_drafter(tmp / "drafter")
            mx.save_safetensors(str(tmp / "optimizer.safetensors"), dict(tree_flatten(self.optimizer.state)))
            if self.cfg.tie_codebooks:
                mx.save_safetensors(str(tmp / "tied.safetensors"), tied.tied_state(self.drafter.candidate_selector))
            (tmp / "state.json").write_text(json.dumps({"step": self.state.step, "history": self.state.history,
                                                        "config": asdict(self.cfg)}))
        if final:
            self._save_drafter(self.out_dir)
        return dest

    def _save_drafter(self, path: Path) -> None:
        """The drafter in the published layout (tied codebooks written as plain tables)."""
        selector = getattr(self.drafter, "candidate_selector", None)
        books = {name: getattr(selector, name) for name in tied.CODEBOOKS} if self.cfg.tie_codebooks else {}
        if books:
            tied.materialize(selector)
        try:
            save_drafter(self.drafter, path)
        finally:
            for name, book in books.items():
                setattr(selector, name, book)

    def resume(self) -> bool:
        """Load the last checkpoint in out_dir if there is one; True if resumed."""
        ckpt = self.out_dir / "checkpoint"
        if not (ckpt / "state.json").exists():
            return False
        raw, weights = read_checkpoint(ckpt / "drafter")
        loaded = build_drafter(parse_config(raw), weights)
        if self.cfg.tie_codebooks:
            tied.materialize(self.drafter.candidate_selector)
        self.drafter.update(loaded.parameters())
        if self.cfg.tie_codebooks:
            tied.load_tied_state(self.drafter.candidate_selector, self.drafter.target.embed_weight,
                                 mx.load(str(ckpt / "tied.safetensors")))
        opt = mx.load(str(ckpt / "optimizer.safetensors"))
        self.optimizer.state = tree_unflatten(list(opt.items()))
        state = json.loads((ckpt / "state.json").read_text())
        self.state = TrainState(step=state["step"], history=state["history"])
        mx.eval(self.drafter.parameters(), self.optimizer.state)
        return True

    # -- the run ----------------------------------------------------------------------

    def run(self, progress: bool = True) -> TrainState:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        cols = [TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                TextColumn("{task.fields[info]}")]
        log_path = self.out_dir / "train_log.jsonl"
        self.out_dir.mkdir(parents=True, exist_ok=True)
        with Progress(*cols, disable=not progress) as bar:
            task = bar.add_task("train", total=self.cfg.steps, completed=self.state.step, info="")
            while self.state.step < self.cfg.steps:
                t0 = time.perf_counter()
                m = self.step()
                m["step"], m["seconds"] = self.state.step, time.perf_counter() - t0
                acc = m.get("pick", m["top1"])
                m["tau_est"] = estimated_tau(acc)
                if self.state.step % self.cfg.eval_every == 0 or self.state.step == self.cfg.steps:
                    m.update(self.evaluate())
                keep = ("step", "loss", "tau_est") + tuple(f"eval_b{b}_{k}" for b in self.cfg.eval_blocks
                                                          for k in ("tau", "tau_all"))
                self.state.history.append({k: v for k, v in m.items() if k in keep})
                with open(log_path, "a") as f:
                    f.write(json.dumps(m) + "\n")
                held = next((f" held-out τ@{b} {m[f'eval_b{b}_tau_all']:.3f}" for b in self.cfg.eval_blocks
                             if f"eval_b{b}_tau_all" in m), "")
                bar.update(task, completed=self.state.step,
                           info=f"loss {m['loss']:.3f} acc[{' '.join(f'{a:.2f}' for a in acc)}]{held}")
                if self.state.step % self.cfg.save_every == 0 or self.state.step == self.cfg.steps:
                    self.save(final=self.state.step == self.cfg.steps)
        return self.state


def _to_python(metrics: dict) -> dict:
    out = {}
    for k, v in metrics.items():
        if k.startswith("_"):  # per-anchor arrays, for the evaluation only
            continue
        arr = np.array(v)
        out[k] = arr.item() if arr.ndim == 0 else arr.tolist()
    return out
