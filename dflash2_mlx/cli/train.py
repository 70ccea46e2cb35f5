"""`dflash2 train`: make DFlash / DFlash 2 drafters for a target, in MLX.

Two steps, both resumable:

  dflash2 train prepare-data TARGET --out data/smol --n-prompts 2688
  dflash2 train fit TARGET --data data/smol --out my-drafter --arch dflash2 --layers 2 --steps 3000

Measure the result with `dflash2 bench TARGET --drafter my-drafter --modes ar,dflash2`.
A compact proposal head for it: `dflash2 train draft-vocab TARGET --drafter my-drafter`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import ModelArg, user_errors

train_app = typer.Typer(help="Train drafters: generate data from the target, then fit.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(train_app, name="train")


def _target(model):
    from .. import hub
    from ..target import load_target

    spec = hub.resolve(model, "none")
    return load_target(spec.target, dtype=spec.defaults.get("dtype"))


def _ids(text: str | None) -> list[int] | None:
    if not text:
        return None
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated integers, got {text!r}") from None


@train_app.command("prepare-data", help="On-policy data: the target answers prompts (ShareGPT first and later "
                                        "turns, stdlib code tasks, templated maths; eval suites filtered out) in one "
                                        "continuous batch, and its tapped states and top-k log-probs are captured as "
                                        "it generates. Resumable segments under OUT: tokens/ (small, commit it) and "
                                        "feat/ shards. Rerun the same command to resume; --rebuild-features remakes "
                                        "missing feat/ shards from tokens/.")
@user_errors
def prepare_data(
    model: ModelArg = None,
    out: Annotated[Path, typer.Option("--out", help="Run directory (prompts, tokens/, feat/, "
                                                    "progress).")] = Path("data"),
    n_prompts: Annotated[int, typer.Option("--n-prompts", min=1, help="How many prompts to answer.")] = 2048,
    mix: Annotated[str, typer.Option("--mix", help="Prompt sources and shares: sharegpt (first turns), turns "
                                                  "(later turns with history), code, math.")] =
        "sharegpt=0.45,turns=0.15,code=0.2,math=0.2",
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", min=2, help="Tokens the target may pick "
                                                                                 "per prompt.")] = 160,
    max_prompt_tokens: Annotated[int, typer.Option("--max-prompt-tokens", min=8, help="Longer prompts lose their "
                                                   "oldest turns, or are cut.")] = 256,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Rows decoding at once.")] = 64,
    segment_size: Annotated[int, typer.Option("--segment-size", min=1, help="Prompts per segment (the unit of "
                                                                            "resume; one drain each).")] = 1024,
    shard_size: Annotated[int, typer.Option("--shard-size", min=1, help="Sequences per feature shard.")] = 256,
    taps: Annotated[Optional[str], typer.Option("--taps", help="Target layer ids to store, e.g. 1,8,14,20,27,29 "
                                                                "(default: --n-taps spread over the depth).")] = None,
    n_taps: Annotated[int, typer.Option("--n-taps", min=1)] = 5,
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="Soft labels stored per position.")] = 32,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    heldout: Annotated[bool, typer.Option("--heldout", help="ShareGPT prompts from the end of the shuffled "
                                                           "conversation list (training takes them from the front) "
                                                           "and synthetic ones from another seed stream: an "
                                                           "evaluation set for fit --eval-data.")] = False,
    worker: Annotated[str, typer.Option("--worker", help="K/N: this process generates (or with "
                                                        "--rebuild-features remakes) segments s with s % N == K, so "
                                                        "N processes (one per core) can share a run.")] = "0/1",
    exclude: Annotated[Optional[Path], typer.Option("--exclude", help="Another run's directory: none of its "
                                                    "prompts is used here (a held-out set must not share a "
                                                    "templated prompt with the training run).")] = None,
    rebuild_features: Annotated[bool, typer.Option("--rebuild-features", help="Only remake missing feat/ shards "
                                                   "of done segments from tokens/ (one target pass each).")] = False,
    only_segments: Annotated[Optional[str], typer.Option("--segments", help="With --rebuild-features: only these "
                                                         "segments, e.g. 6-9 or 6,8 (a fresh machine can rebuild "
                                                         "just what a run reads).")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
) -> None:
    from ..train import onpolicy
    from ..train.init import default_target_layer_ids
    from ..train.prompt_mix import parse_shares

    try:
        shares = parse_shares(mix)
    except ValueError as e:
        raise typer.BadParameter(f"--mix: {e}") from None
    k, _, n = worker.partition("/")
    if not (k.isdigit() and n.isdigit() and int(k) < int(n)):
        raise typer.BadParameter(f"--worker must be K/N with 0 <= K < N, got {worker!r}")
    chosen = _segment_set(only_segments)
    if chosen is not None and not rebuild_features:
        raise typer.BadParameter(f"--segments {only_segments!r} applies to --rebuild-features only")
    target = _target(model)
    layer_ids = _ids(taps) or default_target_layer_ids(target.n_layers, n_taps)
    if max(layer_ids) >= target.n_layers or min(layer_ids) < 0:
        raise typer.BadParameter(f"--taps {layer_ids}: the target has layers 0..{target.n_layers - 1}")
    settings = {"target": str(model or "default"), "taps": layer_ids, "n_prompts": n_prompts, "mix": shares,
                "seed": seed, "heldout": heldout, "max_new_tokens": max_new_tokens,
                "max_prompt_tokens": max_prompt_tokens, "batch_size": batch_size, "segment_size": segment_size,
                "shard_size": shard_size, "top_k": top_k}
    if exclude is not None:
        if not (exclude / "prompts.jsonl.gz").exists():
            raise typer.BadParameter(f"--exclude {exclude} holds no prompts.jsonl.gz (not a prepare-data run)")
        settings["exclude"] = str(exclude)
    fresh = not (out / onpolicy.RUN_FILE).exists()
    prompts = onpolicy.start_run(out, settings, _mixed_prompts(target, settings) if fresh else None)
    if rebuild_features:
        paths = onpolicy.rebuild_features(target, out, tuple(layer_ids), top_k=top_k, part_size=shard_size,
                                          worker=(int(k), int(n)), only=chosen)
        summary = {"rebuilt_shards": [str(p) for p in paths]}
    else:
        summary = onpolicy.generate_run(target, out, prompts, tuple(layer_ids), segment_size=segment_size,
                                        batch_size=batch_size, max_new_tokens=max_new_tokens, top_k=top_k,
                                        part_size=shard_size, worker=(int(k), int(n)))
        s = summary["seconds"]
        summary |= {"response_tok_s": round(summary["response_tokens"] / s, 1) if s else None}
    summary |= {"out": str(out), "prompts": len(prompts), "segments_done": len(onpolicy.done_segments(out)),
                "taps": layer_ids}
    if json_out:
        typer.echo(json.dumps(summary))
    elif rebuild_features:
        typer.echo(f"rebuilt {len(summary['rebuilt_shards'])} feature shards in {out / 'feat'}")
    else:
        rate = f", {summary['response_tok_s']} response tok/s" if summary["response_tok_s"] else ""
        typer.echo(f"{summary['prompts']} prompts answered this call: {summary['response_tokens']} response tokens "
                   f"in {summary['seconds']:.0f} s{rate}; {summary['segments_done']} segments done in {out} "
                   f"(taps {layer_ids})")


def _segment_set(text: Optional[str]) -> Optional[set[int]]:
    """`6-9` or `6,8` (or both, comma-separated) as a set of segment numbers."""
    if text is None:
        return None
    chosen: set[int] = set()
    for item in text.split(","):
        lo, dash, hi = item.strip().partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()) or (dash and int(hi) < int(lo)):
            raise typer.BadParameter(f"--segments expects e.g. 6-9 or 6,8, got {text!r}")
        chosen.update(range(int(lo), int(hi or lo) + 1))
    return chosen


def _mixed_prompts(target, settings: dict) -> list[dict]:
    """The run's prompts as token ids (chat template), each with its source."""
    from ..train.prompt_mix import prompt_ids, prompt_mix

    excluded = set()
    if settings.get("exclude"):
        from ..train.onpolicy import PROMPTS_FILE, read_jsonl_gz

        excluded = {tuple(r["ids"]) for r in read_jsonl_gz(Path(settings["exclude"]) / PROMPTS_FILE)}
    n = settings["n_prompts"]
    # Templated prompts can repeat across runs: draw spares, so the run still gets n after exclusion.
    items = prompt_mix(n + (n // 4 + 8 if excluded else 0), settings["mix"], seed=settings["seed"],
                       heldout=settings["heldout"])
    out = []
    for item in items:
        ids = prompt_ids(target.tokenizer, item.messages, settings["max_prompt_tokens"])
        if ids is not None and tuple(ids) not in excluded and len(out) < n:
            out.append({"i": len(out), "source": item.source, "ids": ids})
    return out


@train_app.command("teacher-data", help="Teacher-forced data: run the target once over offline text (every ShareGPT "
                                        "conversation, Python stdlib sources) and label each position with its own "
                                        "argmax; no regeneration. Evaluation suites are filtered out. Writes "
                                        "resumable tf-*.safetensors shards into OUT/feat (next to prepare-data's).")
@user_errors
def teacher_data(
    model: ModelArg = None,
    out: Annotated[Path, typer.Option("--out", help="Data directory (shards go to OUT/feat).")] = Path("data"),
    n_docs: Annotated[int, typer.Option("--n-docs", min=1, help="How many documents to run.")] = 2048,
    code_share: Annotated[float, typer.Option("--code-share", min=0.0, max=1.0,
                                              help="Share of documents that are Python sources.")] = 0.25,
    max_len: Annotated[int, typer.Option("--max-len", min=16, help="Tokens per document (cut).")] = 512,
    shard_size: Annotated[int, typer.Option("--shard-size", min=1)] = 128,
    taps: Annotated[Optional[str], typer.Option("--taps", help="Target layer ids (default: OUT/feat/taps.json "
                                                                "when present, else 5 spread over the depth).")] = None,
    seed: Annotated[int, typer.Option("--seed")] = 0,
    skip_docs: Annotated[int, typer.Option("--skip-docs", min=0, help="Skip the first N documents of the "
                                                                     "shuffled corpus (another slice).")] = 0,
    json_out: Annotated[bool, typer.Option("--json", help="Print a JSON summary.")] = False,
) -> None:
    from ..train.corpus import EvalFilter, mixed_documents
    from ..train.data import teacher_forced_features
    from ..train.init import default_target_layer_ids

    target = _target(model)
    taps_file = out / "feat" / "taps.json"
    layer_ids = _ids(taps) or (json.loads(taps_file.read_text())["target_layer_ids"] if taps_file.exists()
                               else default_target_layer_ids(target.n_layers, 5))
    if taps_file.exists() and json.loads(taps_file.read_text())["target_layer_ids"] != layer_ids:
        raise typer.BadParameter(f"--taps {layer_ids} differ from {taps_file}'s existing shards")
    if skip_docs % shard_size:
        raise typer.BadParameter(f"--skip-docs {skip_docs} must be a multiple of --shard-size {shard_size} "
                                 "(shards are numbered by document)")
    stats: dict = {}
    flt = EvalFilter.from_suites()
    docs = mixed_documents(skip_docs + n_docs, code_share, seed=seed, eval_filter=flt, stats=stats)[skip_docs:]
    paths = teacher_forced_features(target, docs, tuple(layer_ids), out / "feat", max_len=max_len,
                                    shard_size=shard_size, first_shard=skip_docs // shard_size)
    summary = {"documents": len(docs), "shards": [str(p) for p in paths], "taps": layer_ids,
               "eval_filter": {"items": flt.items, **stats}}
    typer.echo(json.dumps(summary) if json_out else
               f"{len(docs)} documents -> {len(paths)} shards in {out / 'feat'} (taps {layer_ids}); eval filter "
               f"over {flt.items} items dropped " + ", ".join(f"{k} {v['dropped_as_eval_overlap']}"
                                                              for k, v in stats.items()))


@train_app.command("fit", help="Train a drafter on prepared features; writes config.json + model.safetensors "
                               "(the published layout) to OUT, with checkpoints for --resume.")
@user_errors
def fit(
    model: ModelArg = None,
    data: Annotated[Path, typer.Option("--data", help="Directory made by prepare-data.")] = Path("data"),
    out: Annotated[Path, typer.Option("--out", help="Drafter output directory.")] = Path("drafter"),
    arch: Annotated[str, typer.Option("--arch", help="dflash2 (selector + convs) or dflash (v1).")] = "dflash2",
    layers: Annotated[int, typer.Option("--layers", min=1)] = 2,
    block_size: Annotated[Optional[int], typer.Option("--block-size", min=2, help="Block the drafter trains at "
                                                      "(default 8; with --warm-start, the drafter's own).")] = None,
    selector_rank: Annotated[int, typer.Option("--selector-rank", min=1)] = 64,
    top_k: Annotated[int, typer.Option("--top-k", min=1, help="Selector candidates per position.")] = 16,
    mask_token_id: Annotated[Optional[int], typer.Option("--mask-token-id")] = None,
    init_from: Annotated[Optional[Path], typer.Option("--init-from", help="Upgrade this v1 drafter to v2.")] = None,
    warm_start: Annotated[Optional[Path], typer.Option("--warm-start", help="Start from this drafter's weights "
                                                       "(same arch; its config replaces --layers/--block-size/"
                                                       "--selector-rank/--top-k/--mask-token-id).")] = None,
    freeze_backbone: Annotated[bool, typer.Option("--freeze-backbone", help="With --init-from: train only "
                                                                            "convs + selector.")] = False,
    steps: Annotated[int, typer.Option("--steps", min=1)] = 3000,
    seqs: Annotated[int, typer.Option("--seqs", min=1, help="Sequences per batch.")] = 8,
    anchors: Annotated[int, typer.Option("--anchors", min=1, help="Blocks per sequence.")] = 16,
    lr: Annotated[float, typer.Option("--lr", min=0.0)] = 6e-4,
    eval_every: Annotated[int, typer.Option("--eval-every", min=1)] = 100,
    save_every: Annotated[int, typer.Option("--save-every", min=1)] = 100,
    holdout_shards: Annotated[int, typer.Option("--holdout-shards", min=0, help="Last shards of --data kept "
                                                                        "for evaluation (0 with --eval-data).")] = 1,
    eval_data: Annotated[Optional[Path], typer.Option("--eval-data", help="Evaluate on every shard of this "
                                                                           "data directory instead.")] = None,
    shards_glob: Annotated[str, typer.Option("--shards", help="Which shards of DATA/feat to train on (glob), "
                                                              "e.g. 'tf-*' or 'feat-*'.")] = "*",
    max_seqs: Annotated[int, typer.Option("--max-seqs", min=0, help="Train on the first N sequences of the "
                                                                    "shards only (0: all); for data-size "
                                                                    "scaling.")] = 0,
    ce_weight: Annotated[float, typer.Option("--ce-weight", min=0.0, help="Block CE weight.")] = 1.0,
    selector_weight: Annotated[float, typer.Option("--selector-weight", min=0.0,
                                                   help="DFlash 2 selector CE weight.")] = 1.0,
    selector_tv_weight: Annotated[float, typer.Option("--selector-tv-weight", min=0.0, help="DFlash 2 selector "
                                                      "total-variation weight (e.g. 0.1/0.1/0.9 with the two "
                                                      "above, as one public report needed).")] = 0.0,
    train_vocab: Annotated[Optional[Path], typer.Option("--train-vocab", help="A proposal_vocab.json: train "
                                                        "over its top --train-vocab-size ids only (the compact "
                                                        "head the drafter drafts with); copied into OUT.")] = None,
    train_vocab_size: Annotated[Optional[int], typer.Option("--train-vocab-size", min=1,
                                                            help="Ids of --train-vocab used (default: its "
                                                                 "default size).")] = None,
    sources: Annotated[Optional[str], typer.Option("--sources", help="On-policy data: train only on prompts of "
                                                   "these sources (e.g. sharegpt,turns).")] = None,
    max_trainable: Annotated[int, typer.Option("--max-trainable", min=0, help="Train on the first sequences "
                                               "holding this many trainable tokens (0: all).")] = 0,
    kl_weight: Annotated[float, typer.Option("--kl-weight", min=0.0, help="Soft-label KL weight (the target's "
                                             "stored top-k log-probs, with a tail bucket).")] = 0.0,
    ce_weight_end: Annotated[Optional[float], typer.Option("--ce-weight-end", min=0.0, help="Ramp the CE weight "
                                                           "to this over --ramp-frac of the steps.")] = None,
    selector_weight_end: Annotated[Optional[float], typer.Option("--selector-weight-end", min=0.0)] = None,
    selector_tv_weight_end: Annotated[Optional[float], typer.Option("--selector-tv-weight-end", min=0.0)] = None,
    kl_weight_end: Annotated[Optional[float], typer.Option("--kl-weight-end", min=0.0)] = None,
    ramp_frac: Annotated[float, typer.Option("--ramp-frac", min=0.0, max=1.0, help="Share of the steps over "
                                                                                 "which loss weights ramp.")] = 0.5,
    dpace: Annotated[bool, typer.Option("--dpace", help="Position weights from each block's own chance of "
                                                        "reaching a position (D-PACE) instead of exp decay.")] = False,
    inject_gold: Annotated[bool, typer.Option("--inject-gold", help="DFlash 2: a true token outside the top-k "
                                                                    "replaces the weakest candidate in the "
                                                                    "selector loss.")] = False,
    tie_codebooks: Annotated[bool, typer.Option("--tie-codebooks", help="DFlash 2: train the selector codebooks "
                                                "as the target's embedding times a learned projection plus a "
                                                "residual (written as plain codebooks).")] = False,
    schedule: Annotated[str, typer.Option("--schedule", help="wsd (warm-up, stable, linear decay; extendable "
                                                             "by resuming with more --steps) or cosine.")] = "wsd",
    decay_frac: Annotated[float, typer.Option("--decay-frac", min=0.0, max=1.0, help="WSD: share of the steps "
                                                                                   "spent decaying.")] = 0.2,
    fit_taps: Annotated[Optional[str], typer.Option("--taps", help="Train on these stored taps only (a subset "
                                                                   "of DATA/feat/taps.json), e.g. "
                                                                   "1,8,14,20,27.")] = None,
    eval_blocks: Annotated[str, typer.Option("--eval-blocks", help="Block sizes of the exact simulated "
                                                                   "acceptance evaluation.")] = "4,8",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Continue from OUT/checkpoint.")] = True,
) -> None:
    from ..hub import load_drafter
    from ..train.dataset import FeatureDataset, tap_columns
    from ..train.init import new_config, new_drafter, upgrade_to_v2
    from ..train.loop import TrainConfig, Trainer
    from ..train.model import FrozenParts

    target = _target(model)
    shards = sorted((data / "feat").glob(f"{shards_glob}.safetensors"))
    if eval_data is not None:
        holdout_shards = 0
    if len(shards) <= holdout_shards:
        raise typer.BadParameter(f"{data / 'feat'} has {len(shards)} shards matching {shards_glob!r}; need more "
                                 f"than --holdout-shards {holdout_shards}")
    stored_taps = json.loads((data / "feat" / "taps.json").read_text())["target_layer_ids"]
    taps = _ids(fit_taps) or stored_taps
    if schedule not in ("wsd", "cosine"):
        raise typer.BadParameter(f"--schedule must be wsd or cosine, got {schedule!r}")
    if warm_start is not None and init_from is not None:
        raise typer.BadParameter("pass --warm-start or --init-from, not both")
    if warm_start is not None:
        drafter = load_drafter(warm_start, target, dtype="float32", draft_vocab=0)  # shipped bf16; train fp32
        if drafter.config.is_v2 != (arch == "dflash2"):
            raise typer.BadParameter(f"--warm-start {warm_start} is a "
                                     f"{'dflash2' if drafter.config.is_v2 else 'dflash'} drafter, --arch is {arch}")
        if list(drafter.config.target_layer_ids) != taps:
            raise typer.BadParameter(f"--warm-start drafter taps {list(drafter.config.target_layer_ids)} != data "
                                     f"taps {taps}")
    elif init_from is not None:
        drafter = upgrade_to_v2(load_drafter(init_from, target), selector_rank, top_k, seed)
        if list(drafter.config.target_layer_ids) != taps:
            raise typer.BadParameter(f"--init-from drafter taps {list(drafter.config.target_layer_ids)} != data "
                                     f"taps {taps}")
    else:
        config = new_config(target, arch, n_layers=layers, block_size=block_size or 8, target_layer_ids=taps,
                            mask_token_id=mask_token_id, selector_rank=selector_rank, selector_top_k=top_k)
        drafter = new_drafter(config, seed)
    if block_size is not None and block_size != drafter.config.block_size:
        # no weight depends on the block, so a drafter trained at 8 can go on at 4
        drafter.config = dataclasses.replace(drafter.config, block_size=block_size)
    vocab, vocab_doc = _train_vocab(train_vocab, train_vocab_size, target.info.vocab_size)
    cfg = TrainConfig(steps=steps, seqs_per_batch=seqs, anchors_per_seq=anchors, lr=lr, eval_every=eval_every,
                      save_every=save_every, seed=seed, freeze_backbone=freeze_backbone, ce_weight=ce_weight,
                      selector_weight=selector_weight, selector_tv_weight=selector_tv_weight, kl_weight=kl_weight,
                      ce_weight_end=ce_weight_end, selector_weight_end=selector_weight_end,
                      selector_tv_weight_end=selector_tv_weight_end, kl_weight_end=kl_weight_end,
                      ramp_frac=ramp_frac, dpace=dpace, inject_gold=inject_gold, schedule=schedule,
                      tie_codebooks=tie_codebooks,
                      decay_frac=decay_frac, eval_blocks=tuple(_ids(eval_blocks) or (4, 8)),
                      block_size=drafter.config.block_size, train_vocab=vocab.size if vocab else 0)
    train_shards, eval_shards = shards[: len(shards) - holdout_shards], shards[len(shards) - holdout_shards :]
    if eval_data is not None:
        eval_shards = sorted((eval_data / "feat").glob("*.safetensors"))
        if not eval_shards:
            raise typer.BadParameter(f"--eval-data {eval_data} has no shards in {eval_data / 'feat'}")
    try:
        columns = tap_columns(stored_taps, taps, len(stored_taps) * target.hidden_size)
    except ValueError as e:
        raise typer.BadParameter(f"--taps: {e}") from None
    eval_taps = stored_taps if eval_data is None else json.loads((eval_data / "feat" / "taps.json").read_text())[
        "target_layer_ids"]
    train_set = FeatureDataset(train_shards, max_seqs=max_seqs or None, columns=columns,
                               prompts=_prompts_of(data, sources), max_trainable=max_trainable or None)
    eval_set = (FeatureDataset(eval_shards, columns=tap_columns(eval_taps, taps, len(eval_taps) * target.hidden_size))
                if eval_shards else None)
    shared = len(train_set.prompt_keys() & eval_set.prompt_keys()) if eval_set else 0
    if shared:
        raise typer.BadParameter(f"{shared} of the {len(eval_set)} evaluation sequences have a prompt that is also "
                                 f"in the training data; evaluate on held-out prompts (prepare-data --heldout)")
    typer.echo(f"training on {len(train_shards)} shards: {len(train_set)} sequences, {train_set.n_tokens} tokens "
               f"({train_set.n_trainable} trainable)", err=True)
    trainer = Trainer(drafter, FrozenParts.from_target(target), train_set, cfg, out, eval_data=eval_set, vocab=vocab,
                      eval_groups=_sources_of(eval_data or data, eval_set))
    out.mkdir(parents=True, exist_ok=True)
    (out / "data.json").write_text(json.dumps({
        "arch": arch, "train_shards": [str(p) for p in train_shards], "eval_shards": [str(p) for p in eval_shards],
        "sequences": len(train_set), "tokens": train_set.n_tokens, "trainable_tokens": train_set.n_trainable,
        "warm_start": str(warm_start) if warm_start else None, "train_vocab": cfg.train_vocab}, indent=1))
    if vocab_doc is not None:
        (out / "proposal_vocab.json").write_text(json.dumps(vocab_doc, separators=(",", ":")) + "\n")
    if resume and trainer.resume():
        typer.echo(f"resumed from {out / 'checkpoint'} at step {trainer.state.step}", err=True)
    state = trainer.run()
    typer.echo(f"wrote {out} after {state.step} steps", err=True)


@train_app.command("eval", help="Exact simulated acceptance of a drafter on prepared held-out data: for every "
                                "anchor of every sequence, the acceptance length greedy decoding would see there; "
                                "τ of the decoding walk, the mean over all anchors, and per-position rates.")
@user_errors
def eval_cmd(
    model: ModelArg = None,
    drafter: Annotated[Optional[Path], typer.Option("--drafter", "-d", help="Drafter directory (default: the "
                                                                            "model's shipped one).")] = None,
    data: Annotated[Path, typer.Option("--data", help="Data directory (every shard of DATA/feat).")] = Path("data"),
    blocks: Annotated[str, typer.Option("--blocks", help="Block sizes to simulate.")] = "4,8",
    seqs: Annotated[int, typer.Option("--seqs", min=1, help="Sequences per forward pass.")] = 4,
    anchors: Annotated[int, typer.Option("--anchors", min=1, help="Anchors per sequence per pass.")] = 64,
    train_vocab: Annotated[Optional[Path], typer.Option("--train-vocab", help="Score over this proposal "
                                                        "vocab's top ids (default: the drafter's own file).")] = None,
    train_vocab_size: Annotated[Optional[int], typer.Option("--train-vocab-size", min=1)] = None,
    json_out: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    from .. import hub
    from ..drafter.vocab import find_vocab_file
    from ..hub import load_drafter
    from ..train.dataset import FeatureDataset, tap_columns
    from ..train.evaluate import simulate
    from ..train.model import FrozenParts

    spec = hub.resolve(model, str(drafter) if drafter else None, progress=True)
    target = _target(model)
    d = load_drafter(spec.drafter, target, dtype="float32", draft_vocab=0)
    shards = sorted((data / "feat").glob("*.safetensors"))
    if not shards:
        raise typer.BadParameter(f"--data {data} has no shards in {data / 'feat'}")
    stored = json.loads((data / "feat" / "taps.json").read_text())["target_layer_ids"]
    try:
        columns = tap_columns(stored, list(d.config.target_layer_ids), len(stored) * target.hidden_size)
    except ValueError as e:
        raise typer.BadParameter(f"the drafter's taps do not fit --data: {e}") from None
    vocab_file = train_vocab or find_vocab_file(spec.drafter)
    vocab, _ = _train_vocab(vocab_file, train_vocab_size, target.info.vocab_size)
    d.target = FrozenParts.from_target(target)
    data_set = FeatureDataset(shards, columns=columns)
    result = simulate(d, data_set, tuple(_ids(blocks) or (4, 8)), vocab,
                      None if vocab is None else vocab.head(d.target), anchors, seqs, _sources_of(data, data_set))
    result = {"drafter": str(spec.drafter), "data": str(data), "vocab": vocab.size if vocab else 0, **result}
    if json_out:
        typer.echo(json.dumps(result))
        return
    typer.echo(f"{spec.drafter} on {data} (vocab {result['vocab'] or 'full'}):")
    for key, r in result.items():
        if key.startswith("b") and isinstance(r, dict):
            typer.echo(f"  block {key[1:]}: τ {r['tau']:.3f} over {r['cycles']} cycles · mean over {r['anchors']} "
                       f"anchors {r['tau_all']:.3f} · accept by position "
                       + " ".join(f"{a:.2f}" for a in r["accept_by_position"]))
            for name, g in r.get("by_group", {}).items():
                typer.echo(f"    {name:9s} τ {g['tau']:.3f} · mean {g['tau_all']:.3f} ({g['sequences']} sequences)")


def _prompts_of(data: Path, sources: str | None) -> set[int] | None:
    """Prompt numbers of an on-policy run whose source is in `sources` (None: no filter)."""
    if not sources:
        return None
    from ..train.onpolicy import PROMPTS_FILE, read_jsonl_gz

    if not (data / PROMPTS_FILE).exists():
        raise typer.BadParameter(f"--sources needs on-policy data with {data / PROMPTS_FILE}")
    wanted = {s.strip() for s in sources.split(",") if s.strip()}
    rows = read_jsonl_gz(data / PROMPTS_FILE)
    unknown = wanted - {r["source"] for r in rows}
    if unknown:
        raise typer.BadParameter(f"--sources {sorted(unknown)} are not in {data} (it has "
                                 f"{sorted({r['source'] for r in rows})})")
    return {r["i"] for r in rows if r["source"] in wanted}


def _sources_of(data: Path, data_set) -> dict[int, str] | None:
    """Sequence number -> its prompt's source, for on-policy data (None otherwise)."""
    from ..train.onpolicy import PROMPTS_FILE, read_jsonl_gz

    if data_set is None or not (data / PROMPTS_FILE).exists() or (data_set.prompt_index < 0).any():
        return None
    source = {r["i"]: r["source"] for r in read_jsonl_gz(data / PROMPTS_FILE)}
    return {i: source[int(p)] for i, p in enumerate(data_set.prompt_index)}


def _train_vocab(path: Path | None, size: int | None, vocab_size: int):
    """(TrainVocab, the vocab file's JSON with `size` as its default) or (None, None)."""
    if path is None:
        if size is not None:
            raise typer.BadParameter("--train-vocab-size needs --train-vocab FILE")
        return None, None
    from ..drafter.vocab import read_vocab_file
    from ..train.loss import TrainVocab

    pv = read_vocab_file(path)
    if pv.vocab_size != vocab_size:
        raise typer.BadParameter(f"--train-vocab {path} ranks a {pv.vocab_size}-id vocab; the target has {vocab_size}")
    pv = pv.resized(size or pv.size)
    doc = json.loads(Path(path).read_text()) | {"default_size": pv.size}
    return TrainVocab(sorted(pv.ranked[: pv.size]), vocab_size), doc


@train_app.command("export", help="Copy a trained drafter (OUT of fit, or its checkpoint/) to DEST with its "
                                  "weights cast to --dtype (bf16 halves the size), checked by loading it back.")
@user_errors
def export(
    src: Annotated[Path, typer.Argument(help="A drafter directory or a training checkpoint directory.")],
    dest: Annotated[Path, typer.Argument(help="Where to write config.json + model.safetensors.")],
    dtype: Annotated[str, typer.Option("--dtype", help="bfloat16, float16 or float32.")] = "bfloat16",
) -> None:
    from ..train.export import export_drafter, file_size_mb

    out = export_drafter(src, dest, dtype)
    typer.echo(f"wrote {out} ({dtype}, {file_size_mb(out):.1f} MiB)", err=True)


@train_app.command("draft-vocab", help="Rank token ids by frequency (ShareGPT replies, plus the target's own "
                                       "responses with --data) and write proposal_vocab.json into the drafter "
                                       "directory: its drafts then use a compact head over the top ids.")
@user_errors
def draft_vocab(
    model: ModelArg = None,
    drafter: Annotated[Optional[Path], typer.Option("--drafter", "-d", help="Drafter directory to write into "
                                                                            "(default: the model's shipped "
                                                                            "one).")] = None,
    data: Annotated[Optional[Path], typer.Option("--data", help="Also count responses of this prepare-data "
                                                                "dir.")] = None,
    conversations: Annotated[int, typer.Option("--conversations", min=0,
                                               help="ShareGPT conversations counted.")] = 4000,
    size: Annotated[int, typer.Option("--size", min=1, help="Default proposal vocab size.")] = 8192,
    keep: Annotated[int, typer.Option("--keep", min=1, help="Ranked ids stored (largest size selectable).")] = 16384,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    import json as _json

    from .. import hub
    from ..train.draft_vocab import build_draft_vocab

    spec = hub.resolve(model, str(drafter) if drafter else None, progress=True)
    if spec.drafter is None or not Path(spec.drafter).is_dir():
        raise typer.BadParameter(f"no local drafter directory for {spec.name}; pass --drafter DIR")
    target = _target(model)
    path = build_draft_vocab(target.tokenizer, target.info.vocab_size, Path(spec.drafter),
                             n_conversations=conversations, data_dir=data, keep=keep, default_size=size,
                             seed=seed, always=sorted(target.eos_token_ids), target_name=str(spec.name))
    cov = _json.loads(path.read_text())["coverage"]
    typer.echo(f"wrote {path} (default size {min(size, keep)}; held-out coverage "
               + ", ".join(f"{k}: {v:.1%}" for k, v in cov.items()) + ")", err=True)
