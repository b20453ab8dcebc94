"""The command lines of the training pipeline: ``vllm-pamer annotate``,
``vllm-pamer extract`` and ``vllm-pamer train`` (``vllm_pamer.cli`` dispatches
here). Each command imports what it runs inside its ``main``, so one command's
start-up does not pay for another's dependencies (torch, the engine).

Longer than 400 lines because the three commands' flags and their checks
live together, one function per command."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import msgspec

from vllm_pamer.training.annotate import (
    AnnotatorSettings,
    DecisionPoint,
    UnknownAnnotator,
    char_counter,
    create_annotator,
    tokenizer_counter,
)
from vllm_pamer.training.data import StatesError, load_data, load_labels, load_layer_states, load_states, relabel
from vllm_pamer.trajectories import in_split

# --------------------------------------------------------------------------------------
# vllm-pamer annotate
# --------------------------------------------------------------------------------------

SUMMARY_COLUMNS = ("trajectories", "decisions", "gate", "compress_1", "compress_0", "recall_eval", "recall_1")


def summarize(points: Iterable[DecisionPoint]) -> dict[str, dict[str, int]]:
    """Counts per source (and ``all``): decision points, gate holds,
    compression 1/0, recall evaluated/1, trajectories."""
    table: dict[str, dict[str, int]] = {}
    seen: dict[str, set[str]] = {}
    for p in points:
        for key in (p.source, "all"):
            row = table.setdefault(key, dict.fromkeys(SUMMARY_COLUMNS, 0))
            ids = seen.setdefault(key, set())
            if p.trajectory_id not in ids:
                ids.add(p.trajectory_id)
                row["trajectories"] += 1
            row["decisions"] += 1
            if p.compression is not None:
                row["gate"] += 1
                row["compress_1" if p.compression else "compress_0"] += 1
            if p.recall is not None:
                row["recall_eval"] += 1
                row["recall_1"] += p.recall
    if "all" in table:  # keep "all" last
        table["all"] = table.pop("all")
    return table


def format_summary(table: Mapping[str, Mapping[str, int]]) -> str:
    columns = SUMMARY_COLUMNS
    width = max([len("source")] + [len(k) for k in table])
    lines = [f"{'source':<{width}}  " + "  ".join(f"{c:>12}" for c in columns)]
    for key, row in table.items():
        lines.append(f"{key:<{width}}  " + "  ".join(f"{row[c]:>12}" for c in columns))
    return "\n".join(lines)


def annotate_main(argv: Sequence[str] | None = None) -> int:
    """``vllm-pamer annotate``: label trajectories, write JSON lines, print counts."""
    parser = argparse.ArgumentParser(
        prog="vllm-pamer annotate",
        description="Label the decision points of agent trajectories (recall / compression) as JSON lines.",
    )
    parser.add_argument(
        "--data",
        action="append",
        default=None,
        metavar="PATH",
        help="trajectories (.jsonl or .jsonl.gz); repeatable (default: both shipped samples)",
    )
    parser.add_argument("--limit", type=int, default=None, metavar="N", help="first N trajectories of each file")
    parser.add_argument(
        "--split",
        choices=("tuning", "evaluation"),
        default=None,
        help="only the trajectories of this split (vllm_pamer/data/splits.json; default: all): train on tuning",
    )
    parser.add_argument("--out", required=True, metavar="PATH", help="output JSON lines, one decision point each")
    parser.add_argument(
        "--annotator", default="reference", help="registered annotator: reference (default) or hindsight"
    )
    parser.add_argument(
        "--annotator-options",
        default="{}",
        metavar="JSON",
        help='the annotator\'s own options, e.g. hindsight\'s {"budget": 4096, "target_share": 0.4}',
    )
    parser.add_argument(
        "--tokens",
        choices=("model", "chars"),
        default="model",
        help="token counter: the model's tokenizer (default) or characters // 4",
    )
    parser.add_argument(
        "--tokenizer", default=None, metavar="PATH", help="tokenizer directory (default: the embedded model)"
    )
    defaults = AnnotatorSettings()
    parser.add_argument("--n-recent", type=int, default=defaults.n_recent, help="recent blocks R_t (default 2)")
    parser.add_argument(
        "--horizon", type=int, default=defaults.horizon, help="actions compression looks at (default 3)"
    )
    parser.add_argument(
        "--min-old-tokens",
        type=int,
        default=defaults.min_old_tokens,
        help="compression gate on tokens(O_t) (default 1024)",
    )
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    settings = AnnotatorSettings(n_recent=args.n_recent, horizon=args.horizon, min_old_tokens=args.min_old_tokens)
    counter = char_counter if args.tokens == "chars" else tokenizer_counter(args.tokenizer)
    try:
        annotator = create_annotator(args.annotator, settings, counter, **json.loads(args.annotator_options))
    except (UnknownAnnotator, TypeError, json.JSONDecodeError) as exc:
        parser.error(f"--annotator {args.annotator} --annotator-options {args.annotator_options}: {exc}")
    trajectories = in_split(load_data(args.data, args.limit), args.split)

    from tqdm import tqdm

    started = time.monotonic()
    points: list[DecisionPoint] = []
    encoder = msgspec.json.Encoder()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("wb") as handle:
        for trajectory in tqdm(trajectories, desc="annotating", unit="traj", disable=args.no_progress):
            for point in annotator.annotate(trajectory):
                handle.write(encoder.encode(point) + b"\n")
                points.append(point)
    elapsed = time.monotonic() - started
    print(f"wrote {len(points)} decision points of {len(trajectories)} trajectories to {out} in {elapsed:.1f} s")
    print(
        f"annotator={annotator.name} tokens={args.tokens} n_recent={settings.n_recent} "
        f"horizon={settings.horizon} min_old_tokens={settings.min_old_tokens}"
    )
    print(format_summary(summarize(points)))
    return 0


# --------------------------------------------------------------------------------------
# vllm-pamer extract
# --------------------------------------------------------------------------------------


def _subsample(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError("must be positive")
    return value


def build_extract_parser() -> argparse.ArgumentParser:
    from vllm_pamer.training.extract import SHARD_SIZE
    from vllm_pamer.training.prompts import CUT_STRIDE, KEEP_HEAD, PROBE_LIMIT

    parser = argparse.ArgumentParser(
        prog="vllm-pamer extract",
        description=(
            "Capture the served model's final-norm last-token state for every labelled decision point, "
            "for the full context and for Recent2 (P + R_t), on the vLLM engine; resumable safetensors shards."
        ),
    )
    parser.add_argument("--labels", required=True, metavar="PATH", help="decision points (vllm-pamer annotate --out)")
    parser.add_argument(
        "--data",
        action="append",
        default=None,
        metavar="PATH",
        help="trajectories (.jsonl or .jsonl.gz); repeatable (default: both shipped samples)",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="output directory (resumed when it exists)")
    parser.add_argument("--model", default=None, metavar="PATH", help="model directory (default: the embedded model)")
    parser.add_argument("--max-model-len", type=int, default=None, help="engine window (default: the model's)")
    parser.add_argument(
        "--probe-limit", type=int, default=PROBE_LIMIT, help=f"longest prompt in tokens (default {PROBE_LIMIT})"
    )
    parser.add_argument(
        "--keep-head",
        type=int,
        default=KEEP_HEAD,
        help=f"tokens a cut prompt keeps from its start, at most half the limit (default {KEEP_HEAD})",
    )
    parser.add_argument(
        "--cut-stride",
        type=float,
        default=CUT_STRIDE,
        help="share of a cut prompt's recent room by which the cut moves, so the prefix cache serves a "
        f"trajectory's cut prompts between moves; 0: the most recent tokens always (default {CUT_STRIDE})",
    )
    parser.add_argument("--n-recent", type=int, default=2, help="blocks in R_t, as annotated (default 2)")
    parser.add_argument(
        "--shard-size", type=int, default=SHARD_SIZE, help=f"decision points per shard (default {SHARD_SIZE})"
    )
    parser.add_argument(
        "--limit", type=int, default=None, metavar="N", help="first N decision points (after --subsample)"
    )
    parser.add_argument(
        "--subsample",
        type=_subsample,
        default=None,
        metavar="X",
        help="random decision points: a fraction (0 < X < 1) or a count (X >= 1), drawn with --seed",
    )
    parser.add_argument("--seed", type=int, default=0, help="subsampling seed (default 0)")
    parser.add_argument(
        "--dtype",
        default="auto",
        help="engine dtype (default: auto, as served: fp32 on a CPU without native bf16); "
        "each shard records it, and a run goes on only in the dtype its shards were computed in",
    )
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="vLLM's; on the CPU backend the share of RAM for the KV cache (default there: 0.2)",
    )
    parser.add_argument("--max-num-batched-tokens", type=int, default=None, help="vLLM's prefill token budget per step")
    parser.add_argument("--max-num-seqs", type=int, default=None, help="vLLM's running requests per step")
    parser.add_argument(
        "--enforce-eager",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="no CUDA graphs / compilation (default: on for the CPU backend)",
    )
    parser.add_argument(
        "--layers",
        nargs="?",
        const="depths",
        default=None,
        metavar="BLOCKS",
        help="also tap decoder blocks (1-based, e.g. 4,8,15,22; alone: 1/8, 1/4, 1/2, 3/4 of the depth) and the "
        "final norm, last token and prompt mean, for the layerwise report; turns prefix caching off (slower)",
    )
    parser.add_argument(
        "--inputs",
        choices=("full,recent2", "full"),
        default="full,recent2",
        metavar="{full,recent2 | full}",
        help="states per point: the full context and Recent2 (default), or the full context alone (what the "
        "server's heads read; about half the work: Recent2 prompts share only P with the others)",
    )
    parser.add_argument(
        "--stop-after-min",
        type=float,
        default=None,
        metavar="MIN",
        help="start no new shard after MIN minutes (at least one is computed); the same command resumes",
    )
    parser.add_argument("--no-progress", action="store_true")
    return parser


def extract_main(argv: Sequence[str] | None = None) -> int:
    """``vllm-pamer extract``."""
    from vllm_pamer.adapters.launch import prepare_vllm_cpu

    prepare_vllm_cpu()
    from vllm_pamer.model_config import model_max_len
    from vllm_pamer.offline_engine import CaptureEngine, CaptureError, check_architecture
    from vllm_pamer.training.extract import ExtractError, extract, join_points, select_points
    from vllm_pamer.training.prompts import ChatPrompter, token_limit
    from vllm_pamer.worker.layer_taps import blocks_at_depths

    parser = build_extract_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.model is None:
        from vllm_pamer.default_model import ensure_default_model

        model = str(ensure_default_model(quiet=args.no_progress))
    else:
        model = str(Path(args.model).resolve())
    try:
        check_architecture(model)
        max_model_len = args.max_model_len or model_max_len(model)
        labels = load_labels(args.labels)
        points = join_points(labels, load_data(args.data), n_recent=args.n_recent)
        points = select_points(points, args.limit, args.subsample, args.seed)
    except (ExtractError, CaptureError, OSError, ValueError) as exc:
        parser.exit(2, f"vllm-pamer extract: {exc}\n")

    from transformers import AutoTokenizer

    layers: list[int] = []
    if args.layers:
        from transformers import AutoConfig

        from vllm_pamer.worker.layer_taps import parse_layers

        config = AutoConfig.from_pretrained(model)
        num_layers = int((getattr(config, "text_config", None) or config).num_hidden_layers)
        try:
            layers = blocks_at_depths(num_layers) if args.layers == "depths" else parse_layers(args.layers)
        except ValueError as exc:
            parser.exit(2, f"vllm-pamer extract: --layers: {exc}\n")
        if layers and layers[-1] > num_layers:
            parser.exit(2, f"vllm-pamer extract: --layers: block {layers[-1]} asked for, the model has {num_layers}\n")

    tokenizer = AutoTokenizer.from_pretrained(model)
    try:
        prompter = ChatPrompter(
            tokenizer, token_limit(max_model_len, args.probe_limit), args.keep_head, args.cut_stride
        )
    except ValueError as exc:
        parser.exit(2, f"vllm-pamer extract: {exc}\n")
    settings = {
        "model": model,
        "max_model_len": max_model_len,
        "probe_limit": args.probe_limit,
        "n_recent": args.n_recent,
        "dtype": args.dtype,
    }

    def start_engine() -> CaptureEngine:
        return CaptureEngine(
            model,
            max_model_len=max_model_len,
            dtype=args.dtype,
            gpu_memory_utilization=args.gpu_memory_utilization,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs,
            enforce_eager=args.enforce_eager,
            seed=args.seed,
            layers=layers,
        )

    try:
        result = extract(
            points,
            args.out,
            prompter,
            start_engine,
            shard_size=args.shard_size,
            settings=settings,
            progress=not args.no_progress,
            layers=layers,
            inputs=args.inputs.split(","),
            stop_after_s=None if args.stop_after_min is None else 60 * args.stop_after_min,
        )
    except (ExtractError, CaptureError, StatesError) as exc:
        parser.exit(1, f"vllm-pamer extract: {exc}\n")
    print(
        f"{result.points} decision points in {result.shards} shards under {result.out_dir}: "
        f"{result.computed_shards} computed, {result.skipped_shards} already complete"
        + (f", {result.left} left for the next sitting (the same command)" if result.left else "")
    )
    if result.computed_points:
        print(
            f"computed {result.inputs * result.computed_points} states in {result.extract_s:.1f} s "
            f"({result.states_per_s:.2f} states/s; engine start {result.engine_start_s:.1f} s)"
        )
    return 0


# --------------------------------------------------------------------------------------
# vllm-pamer train
# --------------------------------------------------------------------------------------


def train_main(argv: Sequence[str] | None = None) -> int:
    """``vllm-pamer train``: fit the heads, write the heads file and the report."""
    from vllm_pamer.training.experiment import NUM_SEEDS, TARGETS

    parser = argparse.ArgumentParser(
        prog="vllm-pamer train",
        description="Train the five PaMER heads on extracted states and compare them with observable controls.",
    )
    parser.add_argument(
        "--states", required=True, metavar="DIR", help="extracted states (states-XXXXX.safetensors + .jsonl)"
    )
    parser.add_argument("--out", required=True, metavar="PATH", help="heads file to write (safetensors)")
    parser.add_argument("--report", default=None, metavar="DIR", help="write report.md, results.json and plots here")
    parser.add_argument("--target", choices=TARGETS, default="compression")
    parser.add_argument(
        "--labels",
        default=None,
        metavar="JSONL",
        help="train on these labels (`vllm-pamer annotate`, e.g. --annotator hindsight) instead of the extraction's",
    )
    parser.add_argument(
        "--head", choices=("mlp", "linear"), default="mlp", help="teacher / student / exported head (default mlp)"
    )
    parser.add_argument(
        "--held-out",
        action="store_true",
        help="test on the evaluation split (vllm_pamer/data/splits.json) at every seed, train and validate on the "
        "tuning split's tasks (the layerwise diagnostic keeps its own splits); default: 70/15/15 of all rows by task",
    )
    parser.add_argument(
        "--export",
        choices=("full", "student"),
        default="full",
        help="export the full-context heads (what the server's captured state is; default) or the Recent2 KD students",
    )
    parser.add_argument(
        "--model", default=None, metavar="DIR", help="model the heads are for (default: the embedded model)"
    )
    parser.add_argument(
        "--texts",
        default=None,
        metavar="JSONL",
        help="Recent2 texts {trajectory_id, message_index, text} for the TF-IDF control",
    )
    parser.add_argument(
        "--trajectories",
        action="append",
        default=None,
        metavar="PATH",
        help="trajectory files (.jsonl[.gz]) to build the Recent2 texts from when --texts is absent; repeatable",
    )
    parser.add_argument(
        "--seeds", default="0,1,2,3,4", help="comma-separated split seeds; 5 are exported (default 0-4)"
    )
    parser.add_argument("--epochs", type=int, default=50)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--weight-decay", type=float, default=0.01)
    parser.add_argument("--distill-weight", type=float, default=0.5)
    parser.add_argument("--min-votes", type=int, default=3)
    parser.add_argument(
        "--allow-partial", action="store_true", help="train on the complete shards of an unfinished extraction"
    )
    parser.add_argument(
        "--layer-states",
        default=None,
        metavar="DIR",
        help="also run the depth diagnostic on a `vllm-pamer extract --layers` directory (needs --report)",
    )
    parser.add_argument("--no-standardize", action="store_true", help="train on raw states")
    parser.add_argument("--no-ablations", action="store_true", help="skip the Table 1/2 ablation heads (faster)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads while training (default 1, the fastest on a shared 2-core machine; "
        "0 = torch's default)",
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    seeds = tuple(int(s) for s in args.seeds.split(",") if s.strip())
    if len(seeds) != NUM_SEEDS:
        parser.error(f"--seeds must name {NUM_SEEDS} seeds (one exported head each), got {len(seeds)}")
    if not 1 <= args.min_votes <= NUM_SEEDS:
        parser.error(f"--min-votes must be in 1..{NUM_SEEDS}")
    if args.layer_states and not args.report:
        parser.error("--layer-states writes into the report: pass --report DIR")

    from vllm_pamer.default_model import ensure_default_model
    from vllm_pamer.model_config import model_fingerprint
    from vllm_pamer.training.controls import read_texts, recent2_texts
    from vllm_pamer.training.experiment import TrainConfig, run_experiment
    from vllm_pamer.training.probes import stack_heads, torch_threads

    fingerprint = model_fingerprint(args.model or ensure_default_model(quiet=True))
    try:
        full, recent2, meta = load_states(args.states, allow_partial=args.allow_partial)
    except StatesError as exc:
        sys.exit(f"vllm-pamer train: {exc}")
    if args.labels:
        meta = relabel(meta, load_labels(args.labels))
    if full.shape[1] != fingerprint.hidden_size:
        sys.exit(
            f"vllm-pamer train: the states have d = {full.shape[1]} but model {fingerprint.model_name!r} has "
            f"hidden size {fingerprint.hidden_size}; pass the model the states were extracted from (--model)"
        )
    texts = None
    if args.texts:
        texts = read_texts(args.texts)
    elif args.trajectories:
        from vllm_pamer.trajectories import load_trajectories

        texts = {}
        for path in args.trajectories:
            texts.update(recent2_texts(load_trajectories(path)))

    config = TrainConfig(
        target=args.target,
        head=args.head,
        export=args.export,
        seeds=seeds,
        held_out=args.held_out,
        epochs=args.epochs,
        lr=args.lr,
        batch_size=args.batch_size,
        weight_decay=args.weight_decay,
        distill_weight=args.distill_weight,
        standardize=not args.no_standardize,
        ablations=not args.no_ablations,
        min_votes=args.min_votes,
        threads=args.threads or None,
    )
    if recent2 is None and config.export == "student":
        sys.exit("vllm-pamer train: --export student needs Recent2 states; these were extracted with --inputs full")
    result = run_experiment(full, recent2, meta, config, texts=texts)

    from vllm_pamer.core.heads import save_heads
    from vllm_pamer.training.report import fmt_estimate, write_report

    heads = stack_heads(result.exported, result.thresholds, fingerprint, config.min_votes)
    save_heads(heads, args.out)
    print(f"[train] wrote {args.out}: 5 heads from {result.methods[result.export_method].label}")
    summary = result.summary()
    for key, method in result.methods.items():
        if key in summary:
            s = summary[key]
            print(
                f"  {method.label:<48} "
                + "  ".join(f"{m.upper()} {fmt_estimate(s[m])}" for m in ("auroc", "auprc", "f1"))
            )
    for note in result.notes:
        print(f"  note: {note}")
    layerwise = None
    if args.layer_states:
        from vllm_pamer.training.layerwise import run_layerwise, write_layerwise_report

        try:
            last, mean, taps, layer_meta = load_layer_states(args.layer_states, allow_partial=args.allow_partial)
        except StatesError as exc:
            sys.exit(f"vllm-pamer train: {exc}")
        with torch_threads(config.threads):
            layerwise = run_layerwise(
                last,
                mean,
                taps,
                layer_meta,
                seeds=seeds,
                epochs=args.epochs,
                num_layers=fingerprint.num_hidden_layers,
            )
        path = write_layerwise_report(layerwise, args.report, inputs={"layer_states": str(args.layer_states)})
        print(f"[train] layerwise report: {path}")
    if args.report:
        inputs = {
            "states": str(args.states),
            "texts": args.texts,
            "trajectories": args.trajectories,
            "out": str(args.out),
        }
        path = write_report(
            result, args.report, heads_path=args.out, fingerprint=fingerprint, inputs=inputs, layerwise=layerwise
        )
        print(f"[train] report: {path}")
    print(f"[train] done in {result.seconds:.0f} s")
    return 0


# --------------------------------------------------------------------------------------
# vllm-pamer train-control
# --------------------------------------------------------------------------------------


def train_control_main(argv: Sequence[str] | None = None) -> int:
    """``vllm-pamer train-control``: fit the metadata control trigger on the
    tuning split's points, print its scores on both splits, write it."""
    from vllm_pamer.training.control_trigger import fit_control_trigger, point_features, score_table

    parser = argparse.ArgumentParser(
        prog="vllm-pamer train-control",
        description=(
            "Fit the metadata control (length, progress, last tool) as the band's trigger "
            "(band_vote: control) on the tuning split's decision points; scores on both splits."
        ),
    )
    parser.add_argument(
        "--labels", required=True, metavar="PATH", help="decision points of both splits (vllm-pamer annotate --out)"
    )
    parser.add_argument(
        "--data", action="append", default=None, metavar="PATH", help="the labelled trajectories; repeatable"
    )
    parser.add_argument("--target", choices=("compression", "recall"), default="compression")
    parser.add_argument("--n-recent", type=int, default=2, help="recent blocks R_t, as annotated (default 2)")
    parser.add_argument("--l2", type=float, default=1.0, help="the weights' penalty (default 1)")
    parser.add_argument(
        "--out", required=True, metavar="PATH", help="control file (vllm_pamer/data/control_trigger.json ships)"
    )
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))

    points = load_labels(args.labels)
    trajectories = load_data(args.data)
    named = {p.trajectory_id for p in points}
    if missing := named - {str(t.get("id", "")) for t in trajectories}:
        parser.error(f"{len(missing)} labelled trajectories are not in --data, e.g. {sorted(missing)[0]!r}")
    annotators = sorted({p.annotator for p in points})
    scores = {}
    trigger = None
    try:
        for split in ("tuning", "evaluation"):
            chosen = in_split(trajectories, split)
            features, labels, sources = point_features(chosen, points, args.target, args.n_recent)
            if trigger is None:  # fitted on tuning only
                trained_on = (
                    f"{len(labels)} {'/'.join(annotators)} {args.target} labels (annotate --tokens chars) of the "
                    f"tuning split, {len(chosen)} trajectories; vllm-pamer train-control"
                )
                trigger = fit_control_trigger(features, labels, args.n_recent, trained_on, args.l2)
            scores[split] = score_table(trigger, features, labels, sources)
    except ValueError as exc:
        parser.error(str(exc))
    assert trigger is not None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(msgspec.json.format(msgspec.json.encode(trigger)) + b"\n")
    print(f"wrote {out}: {trigger.trained_on}")
    print("split        source                                    points  positive   AUROC  fires")
    for split, table in scores.items():
        for source, row in table.items():
            print(
                f"{split:12} {source:40} {row['points']:7d} {row['positive']:9.3f} "
                f"{row['auroc']:7.3f} {row['fires']:6.3f}"
            )
    return 0
