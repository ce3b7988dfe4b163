"""``ds-adaptive dry-run``: check a ds_config + topology + model + shape mix without GPUs, print the launch command.

    ds-adaptive dry-run --deepspeed_config launch/configs/zero3_adaptive.json --model wan2.1-1.3b \\
        --num-gpus 8 --num-nodes 2 --hostfile launch/hostfile --sp 2 [-- extra trainer args]

Checks (each failure names the key / value, expected vs actual, and the fix; exit status 2, as `config --check` and the run):

* the ``adaptive_load`` block validates; the model preset exists; the trainer arguments after ``--`` parse with the
  trainer's own parser (an unknown flag is an error) and pass its checks: the data directory and its shapes,
  ``--init-from`` weights against ``--model``/``--layers``, ``--save`` and its earlier checkpoints;
* topology: world = --world, --num-gpus x --num-nodes, or the hostfile's slots (limited by
  --num-gpus / --num-nodes like the ``deepspeed`` launcher); ``world % sp == 0``;
  ``heads % sp == 0``; ds_config ``sequence_parallel_size`` / ``data_parallel_size`` agree;
  an SP group that straddles nodes is a warning (its all-to-alls leave NVLink);
* the cross-field rules of ``ds_adaptive.planning.validate`` (what ``ds-adaptive config --check`` and the trainer
  check too): heads vs sp; batch keys ``train_batch_size == train_micro_batch_size_per_gpu x
  gradient_accumulation_steps x dp`` with ``dp = world / sp`` (an SP group trains one micro-batch);
  ``sparse_attention.dense_layers`` inside the model; the sparse backend on ``--device``; budgets;
* memory per GPU under the ZeRO stage (parameters, gradients, optimizer state partitioned over
  all ``world`` ranks, ZeRO-3's live parameters, workspace) and the activation budget left;
* budgets (``m_mem``, ``m_comp`` / ``max_tokens``, ``auto`` resolved exactly as the sampler does)
  against every shape of the distribution (of the data directory with ``--data DIR``): shapes over a budget even at B=1 are listed with the
  budget; an error under ``oversize: "error"``, a warning with the skipped share under ``"skip"``.

Prints a report and the exact ``deepspeed`` command. With ``--print-command`` the report goes to
stderr and stdout carries only the command (shell-quoted), for scripts::

    CMD=$(ds-adaptive dry-run ... --print-command) && eval "$CMD"

Exit status: 0 all checks passed (warnings allowed), 2 a check failed or bad arguments (as the trainer).
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional
from ds_adaptive.models.registry import default_model, model_names
from ds_adaptive.core.layout import MESH_KEYS, SequenceParallelError, resolve_sp_size
from ds_adaptive.core.config import AdaptiveLoadConfig, ConfigError
from ds_adaptive.planning.validate import RunFacts, context_parallel_mode, run_problems
from ds_adaptive.planning.global_batch import describe_step_stats, step_stats
from ds_adaptive.core.ds_config import accumulation_steps
from ds_adaptive.core.config import ConfigError
from ds_adaptive.core.ds_config import load_adaptive_config, read_ds_config
from ds_adaptive.core.layout import Layout
from ds_adaptive.models.family import ModelError
from ds_adaptive.models.registry import get_model
from ds_adaptive.planning.profile import ProfileError, load_profile
from ds_adaptive.planning.planner import OversizeSampleError, PlanError
from ds_adaptive.simulation.context_parallel import uniform_densities
from ds_adaptive.training.assemble import build_run
from ds_adaptive.cli.dry_run_trainer import (TrainerArgumentError, UsageError as TrainerUsageError, data_shapes,
                                             start_up_problems, trainer_namespace, trainer_run_config)
from ds_adaptive.core.shapes import ShapeError
from ds_adaptive.planning.devices import resolve_auto_profile
from ds_adaptive.planning.devices import calibrate_hint
from ds_adaptive.core.shapes import load_shape_distribution
from ds_adaptive.planning.memory import micro_batch_table, sample_memory

GIB = float(1 << 30)
TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "launch" / "train_wan.py"  # the launcher's file name


@dataclass
class Report:
    """Lines of the report, and the problems (failed checks) and warnings found."""

    lines: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    def row(self, key: str, text: str, status: str = "") -> None:
        self.lines.append(f"  {key:<12} {text}" + (f"  [{status}]" if status else ""))

    def fail(self, key: str, msg: str) -> None:
        self.problems.append(msg)
        self.row(key, msg.splitlines()[0], "FAIL")

    def warn(self, key: str, msg: str) -> None:
        self.warnings.append(msg)
        self.row(key, msg, "warn")


@dataclass(frozen=True)
class LaunchPlan:
    """Nodes and GPUs of the launch (the process layout inside it is ``ds_adaptive.core.layout.Layout``)."""

    nodes: list[tuple[str, int]]
    """(host, GPUs used on it) per node, in launch order."""
    hostfile: Optional[str] = None
    num_gpus: Optional[int] = None
    num_nodes: Optional[int] = None

    @property
    def world(self) -> int:
        return sum(n for _, n in self.nodes)


class UsageError(ValueError):
    """Arguments that do not describe a launch."""


_HOST_RE = re.compile(r"^(\S+)\s+slots=(\d+)\s*$")


def parse_hostfile(path: str) -> list[tuple[str, int]]:
    """DeepSpeed hostfile -> [(host, slots)] (``host slots=N`` lines, ``#`` comments)."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"--hostfile {path} does not exist (format: one 'hostname slots=N' line per node, "
                         "see launch/hostfile.example)")
    hosts: list[tuple[str, int]] = []
    for i, raw in enumerate(p.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = _HOST_RE.match(line)
        if not m:
            raise UsageError(f"{path} line {i}: {raw.strip()!r} is not 'hostname slots=N'")
        host, slots = m.group(1), int(m.group(2))
        if any(h == host for h, _ in hosts):
            raise UsageError(f"{path} line {i}: host {host} appears twice; give each node one line")
        if slots < 1:
            raise UsageError(f"{path} line {i}: {host} has slots={slots}; each node needs slots >= 1")
        hosts.append((host, slots))
    if not hosts:
        raise UsageError(f"{path} lists no node; add lines like 'node-001 slots=8'")
    return hosts


def resolve_layout(world: Optional[int], num_gpus: Optional[int], num_nodes: Optional[int],
                   hostfile: Optional[str]) -> LaunchPlan:
    """The launch layout from the flags, as the ``deepspeed`` launcher would use them."""
    for name, v in (("--world", world), ("--num-gpus", num_gpus), ("--num-nodes", num_nodes)):
        if v is not None and v < 1:
            raise UsageError(f"{name} must be >= 1, got {v}")
    if world is not None and (num_gpus is not None or hostfile is not None):
        raise UsageError("give either --world N, or --num-gpus G [--num-nodes K], or --hostfile FILE "
                         "[--num-gpus G] [--num-nodes K]; not --world with the others")
    if hostfile is not None:
        hosts = parse_hostfile(hostfile)
        if num_nodes is not None:
            if num_nodes > len(hosts):
                raise UsageError(f"--num-nodes {num_nodes} but {hostfile} lists {len(hosts)} node(s)")
            hosts = hosts[:num_nodes]
        if num_gpus is not None:
            short = [f"{h} (slots={s})" for h, s in hosts if s < num_gpus]
            if short:
                raise UsageError(f"--num-gpus {num_gpus} per node but {hostfile} gives fewer slots on: "
                                 f"{', '.join(short)}")
            hosts = [(h, num_gpus) for h, _ in hosts]
        return LaunchPlan(nodes=hosts, hostfile=hostfile, num_gpus=num_gpus, num_nodes=num_nodes)
    if world is not None:
        k = num_nodes or 1
        if world % k:
            raise UsageError(f"--world {world} is not divisible by --num-nodes {k}")
        return LaunchPlan(nodes=[(f"node{i}", world // k) for i in range(k)], num_gpus=world // k,
                      num_nodes=num_nodes)
    if num_gpus is not None:
        k = num_nodes or 1
        return LaunchPlan(nodes=[(f"node{i}", num_gpus) for i in range(k)], num_gpus=num_gpus, num_nodes=num_nodes)
    raise UsageError("say where it runs: --world N, --num-gpus G [--num-nodes K], or --hostfile FILE")


def _script_path() -> str:
    try:
        rel = os.path.relpath(TRAIN_SCRIPT)
        return rel if not rel.startswith("..") else str(TRAIN_SCRIPT)
    except ValueError:
        return str(TRAIN_SCRIPT)


def _trainer_args(args: argparse.Namespace, sp: int, extra: list[str]) -> list[str]:
    cmd = [_script_path(), "--deepspeed_config", args.deepspeed_config, "--model", args.model]
    if args.layers:
        cmd += ["--layers", str(args.layers)]
    cmd += ["--sp", str(sp)]
    if args.shapes:
        cmd += ["--shapes", args.shapes]
    return cmd + list(extra)


def node_command(layout: LaunchPlan, args: argparse.Namespace, sp: int, extra: list[str]) -> list[str]:
    """The per-node launcher command (multi-node without ssh: ``ds_adaptive/launch/multinode/``) of node
    ``--node-rank``; every node runs it with its own index."""
    return ["python", "-m", "ds_adaptive.launch.multinode", "launch", "--nnodes", str(len(layout.nodes)),
            "--node-rank", str(args.node_rank), "--nproc-per-node", str(layout.nodes[0][1]),
            "--master-addr", args.master_addr or "127.0.0.1", "--master-port", str(args.master_port or 29500),
            "--", *_trainer_args(args, sp, extra)]


def deepspeed_command(layout: LaunchPlan, args: argparse.Namespace, sp: int, extra: list[str]) -> list[str]:
    """The ``deepspeed`` launcher command for this layout."""
    cmd = ["deepspeed"]
    if layout.hostfile:
        cmd += ["--hostfile", layout.hostfile]
        if layout.num_nodes is not None:
            cmd += ["--num_nodes", str(layout.num_nodes)]
        if layout.num_gpus is not None:
            cmd += ["--num_gpus", str(layout.num_gpus)]
    else:
        if len(layout.nodes) > 1:
            cmd += ["--num_nodes", str(len(layout.nodes))]
        cmd += ["--num_gpus", str(layout.nodes[0][1])]
    if args.master_addr:
        cmd += ["--master_addr", args.master_addr]
    if args.master_port:
        cmd += ["--master_port", str(args.master_port)]
    return cmd + _trainer_args(args, sp, extra)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ds-adaptive dry-run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--deepspeed_config", "--deepspeed-config", required=True, help="the ds_config json to check")

    p.add_argument("--model", default=default_model(), choices=model_names(), help="the model (default: %(default)s)")
    p.add_argument("--layers", type=int, default=None, help="override the number of blocks (as the trainer's --layers)")
    p.add_argument("--world", type=int, default=None, help="total ranks (GPUs), all on one node unless --num-nodes")
    p.add_argument("--num-gpus", "--num_gpus", type=int, default=None, help="GPUs per node")
    p.add_argument("--num-nodes", "--num_nodes", type=int, default=None, help="nodes (default 1, or the hostfile's)")
    p.add_argument("--hostfile", default=None, help="DeepSpeed hostfile ('hostname slots=N' per node)")
    p.add_argument("--master-addr", "--master_addr", default=None, help="passed to the deepspeed launcher")
    p.add_argument("--master-port", "--master_port", type=int, default=None, help="passed to the deepspeed launcher")
    p.add_argument("--launcher", choices=("deepspeed", "node"), default="deepspeed",
                   help="deepspeed: one `deepspeed` command (single node, or --hostfile over ssh); node: one launcher "
                        "per node without ssh (NNODES/NODE_RANK, Kubernetes, SLURM; ds_adaptive/launch/multinode/)")
    p.add_argument("--node-rank", type=int, default=0, help="--launcher node: the node whose command is printed")
    p.add_argument("--sp", type=int, default=None,
                   help="Ulysses degree (default: the ds_config's sequence_parallel_size, else 1)")
    p.add_argument("--shapes", default=None,
                   help="shape-distribution json (default: adaptive_load.sampler.shapes, else the shipped mix)")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="where the ranks compute (default cuda; the CPU run of launch/train_wan.sh passes cpu): "
                        "decides e.g. which sparse-attention backends can run")
    p.add_argument("--gpu-mem-gib", type=float, default=None,
                   help="GPU memory in GiB (default: the sampler profile's device)")
    p.add_argument("--print-command", action="store_true",
                   help="report on stderr, only the deepspeed command on stdout")
    return p


def _check_topology(rep: Report, args: argparse.Namespace, raw: dict):
    """The launch plan and the Ulysses degree: (launch plan or None, sp or None, dp or None)."""
    layout = None
    sp = dp = None
    try:
        layout = resolve_layout(args.world, args.num_gpus, args.num_nodes, args.hostfile)
    except UsageError as exc:
        rep.fail("topology", str(exc))
    if layout is not None:
        world = layout.world
        where = (f"{len(layout.nodes)} node(s) x {layout.nodes[0][1]} GPU(s)" if len({n for _, n in layout.nodes}) == 1
                 else " + ".join(f"{h}:{n}" for h, n in layout.nodes))
        try:
            sp = resolve_sp_size(args.sp, raw, world)
            dp = world // sp
            rep.row("topology", f"world {world} = {where}; Ulysses sp {sp} -> dp {dp} "
                                f"(SP groups = {sp} consecutive ranks)", "ok")
        except SequenceParallelError as exc:
            rep.fail("topology", str(exc))
        if sp is not None and sp > 1:
            sizes = [n for _, n in layout.nodes]
            if any(n % sp for n in sizes):
                rep.warn("topology", f"sp {sp} does not divide the GPUs per node ({sizes}): some SP groups span two "
                                     "nodes and their all-to-alls leave NVLink (slow); pick sp dividing the GPUs per node")
            elif len(sizes) > 1:
                rep.row("nodes", f"{len(sizes)} nodes: every SP group of {sp} ranks stays inside one node", "ok")
        _check_nodes(rep, args, layout)
        if sp is not None and all(k in raw for k in MESH_KEYS):
            rep.warn("ds_config", "data_parallel_size + sequence_parallel_size make DeepSpeed build a (dp, sp) mesh; the "
                                  "trainer removes them before deepspeed.initialize (DeepSpeed 0.19.8's mesh breaks ZeRO-3 "
                                  "checkpoints and ZeRO-0/1/2 gradients; docs/ULYSSES.md)")
        if len(layout.nodes) > 1 and not layout.hostfile and args.launcher == "deepspeed":
            rep.warn("topology", f"{len(layout.nodes)} nodes without --hostfile: the deepspeed launcher reads "
                                 "/job/hostfile by default; pass --hostfile, or --launcher node (one launcher per "
                                 "node, no ssh)")
    return layout, sp, dp


def _check_nodes(rep: Report, args: argparse.Namespace, layout: LaunchPlan) -> None:
    """--launcher node: every node runs the same number of ranks, and this node's index is one of them."""
    if args.launcher != "node":
        return
    if layout.hostfile:
        rep.fail("nodes", "--launcher node takes no --hostfile (the hostfile is for DeepSpeed's ssh launch); give "
                          "--num-gpus G --num-nodes K")
    elif not 0 <= args.node_rank < len(layout.nodes):
        rep.fail("nodes", f"--node-rank {args.node_rank} but the job has {len(layout.nodes)} node(s): use "
                          f"0..{len(layout.nodes) - 1}")
    elif len(layout.nodes) > 1 and not args.master_addr:
        rep.warn("nodes", "no --master-addr: every node needs node 0's address (MASTER_ADDR)")


def _check_rules(rep: Report, args: argparse.Namespace, raw: dict, adaptive, wcfg, sp, dp) -> bool:
    """The cross-field rules of ``ds_adaptive.planning.validate`` (heads vs sp, batch keys, layer indices, the sparse
    backend on --device, budgets) for the planned launch; False when one failed. The topology's own sp / world
    checks are ``_check_topology``'s rows."""
    facts = RunFacts(model=args.model if wcfg is not None else None, layers=args.layers, sp=sp,
                     world=sp * dp if sp is not None and dp is not None else None, device=args.device)
    problems = [p for p in run_problems(raw, adaptive or AdaptiveLoadConfig(), facts) if p.key != "sp"]
    for p in problems:
        rep.fail(p.key.split(".")[0], p.message)
    keys = {p.key for p in problems}
    if wcfg is not None and sp is not None and "heads" not in keys:
        hybrid = (adaptive is not None and context_parallel_mode(adaptive.sparse_attention) != "heads"
                  and wcfg.num_heads % sp)
        rep.row("heads", f"{wcfg.num_heads} heads / sp {sp} = {wcfg.num_heads // sp} per rank" if not hybrid else
                f"{wcfg.num_heads} heads, sp {sp}: hybrid context parallelism (head-wise groups of a divisor of the "
                "heads x sequence-wise groups; cp meshes below)", "ok")
    if dp is not None and "batch" not in keys:
        try:
            gas = accumulation_steps(raw, dp, sp)
            rep.row("batch", f"gradient_accumulation_steps {gas} per optimizer step, dp {dp}; micro-batch sizes "
                             f"come from the sampler (train_micro_batch_size_per_gpu is nominal)", "ok")
        except ConfigError:  # reported above
            pass
    return not problems


def run_checks(args: argparse.Namespace, extra: list[str]) -> tuple[Report, Optional[list[str]]]:
    """All checks; returns the report and the command (None when the layout itself is unusable)."""
    rep = Report()
    launch_args = args
    ns = trainer_namespace(args, extra)  # the trainer's own parser: an unknown flag ends the dry run here
    args = argparse.Namespace(**{**vars(args), "model": ns.model, "layers": ns.layers, "sp": ns.sp,
                                 "shapes": ns.shapes, "trainer": ns})
    cfg_path = args.deepspeed_config
    rep.lines.append(f"ds-adaptive dry-run: {cfg_path}, model {args.model}")

    raw: dict = {}
    adaptive = None
    try:
        raw = read_ds_config(cfg_path)
        adaptive = load_adaptive_config(cfg_path)
        s = adaptive.sampler
        rep.row("config", f"adaptive_load valid: enabled={adaptive.enabled}, sampler {s.mode}/{s.cost_model}, "
                          f"profile {s.profile}, oversize={s.oversize}", "ok")
    except ConfigError as exc:
        rep.fail("config", str(exc))

    wcfg = None
    try:
        overrides = {"num_layers": args.layers} if args.layers else {}
        model = get_model(args.model)
        wcfg = model.config(**overrides)
        n_params = model.param_counts(wcfg)["total"]
        rep.row("model", f"{args.model}: {wcfg.num_layers} blocks, dim {wcfg.dim}, {wcfg.num_heads} heads, "
                         f"{n_params / 1e9:.3f} B parameters; {model.grid.describe()}", "ok")
    except ModelError as exc:
        rep.fail("model", f"--model/--layers: {exc}")
        n_params = 0

    launch, sp, dp = _check_topology(rep, args, raw)
    rules_ok = _check_rules(rep, args, raw, adaptive, wcfg, sp, dp)

    if adaptive is not None and wcfg is not None and sp is not None and dp is not None and rules_ok:
        run = _build_dry_run(rep, args, Layout.for_world(sp * dp, sp), extra)
        if run is not None:
            _check_memory_and_budgets(rep, args, run, n_params)
            _feature_rows(rep, run)

    build = node_command if args.launcher == "node" else deepspeed_command
    cmd = build(launch, launch_args, sp or args.sp or 1, extra) if launch is not None else None
    return rep, cmd


def _build_dry_run(rep: Report, args: argparse.Namespace, layout, extra: list[str]):
    """``build_run`` on the meta device with the planned layout: the trainer's own assembly (profile,
    depth rescaling, budgets, sampler), without GPUs or a process group. None (and a failed check) on error.
    Every trainer flag after ``--`` goes through the trainer's own parser and checks (``dry_run_trainer``)."""
    try:
        cfg = trainer_run_config(argparse.Namespace(**{**vars(args.trainer), "sp": layout.sp_size}),
                                 world=layout.world, device=args.device)
        for key, problem in start_up_problems(cfg):
            rep.fail(key, problem)
        profile = cfg.adaptive_load.sampler.profile
        if profile is None:
            raise ValueError("adaptive_load.sampler.profile is null: the memory model needs a profile "
                             "(auto, a shipped name or a `ds-adaptive calibrate` json)")
        if args.gpu_mem_gib:
            gpu = args.gpu_mem_gib
        elif profile in ("auto", "calibrate"):  # as the trainer: the detected GPU's profile (H100 without a GPU)

            gpu = resolve_auto_profile(args.model)[0].gpu_mem_gib
        else:
            gpu = load_profile(profile).gpu_mem_gib
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run = build_run(cfg, layout=layout, meta=True, gpu_mem_gib=gpu)
    except TrainerUsageError as exc:
        rep.fail("trainer", str(exc))
        return None
    except (ProfileError, ShapeError, ValueError, FileNotFoundError, ConfigError, PlanError) as exc:
        rep.fail("budgets", str(exc))
        return None
    for note in run.notes:  # a CPU run has no GPU profile to calibrate and runs the reference LayerNorm path
        if note.startswith("warning: ") and not (args.device == "cpu" and "profile" in note):
            rep.warn("profile", note[len("warning: "):])
        else:
            rep.row("profile", note, "ok")
    return run


def _check_memory_and_budgets(rep: Report, args: argparse.Namespace, run, n_params: int) -> None:
    """Static memory of the model under the run's ZeRO stage, the resolved budgets, and every shape of the
    distribution against them (oversize shapes with their share of the mix)."""
    s, profile, cost, stage, world = run.cfg.adaptive_load.sampler, run.profile, run.cost, run.zero_stage, \
        run.layout.world
    gpu = run.gpu_mem_gib
    pmodel = profile.raw.get("model", {}).get("name")
    if pmodel not in (None, args.model, run.preset.profile_model) and args.device != "cpu":
        rep.warn("profile", f"profile '{profile.name}' was measured for {pmodel}, checking {args.model}: costs and "
                            f"activation memory are extrapolated; {calibrate_hint(args.model, profile.device)}")
    parts = profile.static_memory_parts(stage, world, params=n_params)  # THIS model, partitioned over the world
    static = sum(parts.values())
    usable = cost.usable_memory_gib(gpu, s.mem_utilization)
    ok = static < usable
    rep.row("memory/GPU", f"ZeRO-{stage} over {world} ranks: " + " + ".join(f"{k} {v:.2f}" for k, v in parts.items())
            + f" = {static:.2f} GiB static of {gpu:.1f} GiB", "ok" if ok else "FAIL")
    if not ok:
        rep.problems.append(
            f"static memory {static:.1f} GiB per GPU (ZeRO-{stage}, {world} ranks) leaves nothing of the "
            f"{usable:.1f} GiB usable (of {gpu:.1f} GiB; sampler.mem_utilization {s.mem_utilization}) for "
            "activations; use ZeRO-3, more GPUs, or a smaller model")
        return
    b, mode, unit = run.budgets, run.plan.sampler_mode, cost.unit
    desc = f"mode {mode}: m_mem {b['m_mem']:.2f} GiB" + (f" ({'auto' if s.m_mem == 'auto' else 'set'})")
    if mode == "dual":
        desc += f", m_comp {b['m_comp']:.4g} {unit} ({'auto' if s.m_comp == 'auto' else 'set'})"
        if run.plan.solo_over_budget:
            desc += " (throughput-optimal; samples over it run alone)"
        if run.plan.efficient_batches:
            desc += "; batches capped at their lowest time per sample"
    desc += f", {run.gas} micro-step(s) per optimizer step"
    if mode == "tokens":
        desc += f", max_tokens {b['max_tokens']}"
    rep.row("budgets", desc, "ok")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            stats = step_stats(run.sampler.plan)
    except (PlanError, OversizeSampleError):   # an oversize sample: the shapes row below names it
        stats = None
    if stats is not None:
        rep.row("global batch", describe_step_stats(stats, s.global_batch) + f" ({run.layout.dp_size} data-parallel "
                f"rank(s), {run.sampler.plan.num_steps} steps in an epoch of {len(run.sampler.shapes):,} samples)", "ok")
    if static + b["m_mem"] > gpu:
        rep.fail("budgets", f"m_mem {b['m_mem']:.1f} GiB of activations + {static:.1f} GiB static memory of {args.model} "
                            f"= {static + b['m_mem']:.1f} GiB > {gpu:.1f} GiB per GPU: batches planned to m_mem would run "
                            f"out of memory. Set sampler.m_mem <= {max(usable - static, 0):.1f} or use "
                            f"a profile calibrated for {args.model} (`ds-adaptive calibrate`)")
    dist_ = data_shapes(run) or load_shape_distribution(s.shapes or run.preset.shapes, grid=run.preset.grid)
    _check_shapes(rep, run, dist_, static, gpu)


def _oversize_reasons(cost, shape, b: dict, mode: str) -> list[str]:

    # at the checkpointing policy's fewest-memory block count, and that count's cost (with recompute)
    mem1, unit = sample_memory(cost, shape), cost.unit
    c1 = float(micro_batch_table(cost, shape, 1, b["m_mem"]).cost[1])
    why = []
    if mem1 > b["m_mem"] * (1 + 1e-12):
        why.append(f"activation memory {mem1:.2f} GiB > m_mem {b['m_mem']:.2f} GiB")
    if mode == "dual" and c1 > b["m_comp"] * (1 + 1e-12) and not b.get("solo_over_budget"):
        why.append(f"cost {c1:.4g} {unit} > m_comp {b['m_comp']:.4g} {unit}")
    if mode == "tokens" and cost.padded_tokens(shape) > b["max_tokens"]:
        why.append(f"{cost.padded_tokens(shape)} tokens > max_tokens {b['max_tokens']}")
    return why


def _check_shapes(rep: Report, run, dist_, static: float, gpu: float) -> None:
    cost, b, mode, sp = run.cost, run.budgets, run.plan.sampler_mode, run.layout.sp_size
    uniq = sorted({w.shape for w in dist_})
    total_w = sum(w.weight for w in dist_)
    weight: dict = {}
    for w in dist_:
        weight[w.shape] = weight.get(w.shape, 0.0) + w.weight
    over = [(shape, why) for shape in uniq if (why := _oversize_reasons(cost, shape, b, mode))]
    longest = max(uniq, key=lambda x: x.tokens)
    mem_l = cost.per_gpu_memory(longest)
    rep.row("shapes", f"{len(uniq)} shapes; longest {longest} = {longest.tokens} tokens (padded "
                      f"{cost.padded_tokens(longest)}, {cost.padded_tokens(longest) // sp} per rank): "
                      f"{mem_l:.2f} GiB activations, {cost.batch_cost(longest, 1):.4g} {cost.unit} per GPU at B=1; "
                      f"peak ~{static + mem_l:.1f} of {gpu:.1f} GiB", "ok" if not over else "")
    line = _mesh_line(run, longest.tokens)
    if line:
        rep.row("cp meshes", line, "ok")
    for shape, why in over:
        msg = (f"shape {shape} ({shape.tokens} tokens, {100 * weight[shape] / total_w:.1f}% of the mix) does not fit "
               f"one GPU even at batch size 1 with sp {sp}: {'; '.join(why)}")
        if run.cfg.adaptive_load.sampler.oversize == "error":
            rep.fail("oversize", msg + ". Raise the budget (sampler.m_mem / m_comp / max_tokens), use a higher sp, "
                                       "drop the shape, or set sampler.oversize: \"skip\"")
        else:
            rep.warn("oversize", msg + " -> skipped (oversize: skip)")


def _mesh_line(run, tokens: int) -> Optional[str]:
    """Under hybrid context parallelism: which layers run on which mesh for the longest shape, at the density stage 2
    runs at (``forced_density``, else ``layer_density_threshold``) with the run's decision cost."""
    rt = run.sparse
    if rt is None or rt.cfg.context_parallel == "heads" or run.layout.sp_size == 1 or rt.decision is None:
        return None
    sa = rt.cfg
    d = sa.forced_density if sa.forced_density is not None else sa.layer_density_threshold
    dm = uniform_densities(rt.num_layers, rt.num_heads, d, sorted(rt.schedule.dense_layers))
    return rt.decision.with_densities(dm).mesh_summary(tokens, run.layout.sp_size) + f", at density {d}"


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    args = build_parser().parse_args(argv)
    out = sys.stderr if args.print_command else sys.stdout
    try:
        rep, cmd = run_checks(args, extra)
    except (UsageError, TrainerArgumentError, TrainerUsageError) as exc:
        print(f"ds-adaptive dry-run: error: {exc}", file=sys.stderr)
        return 2
    for line in rep.lines:
        print(line, file=out)
    if cmd is not None:
        print(f"  {'command':<12} {shlex.join(cmd)}", file=out)
    if rep.problems:
        if len(rep.problems) == 1:
            print(f"\nFAILED: {rep.problems[0]}", file=out)
            return 2
        print(f"\nFAILED: {len(rep.problems)} problem(s):", file=out)
        for i, p in enumerate(rep.problems, 1):
            print(f"  {i}. {p}", file=out)
        return 2  # an invalid configuration: the status `config --check` and the run give it too
    print(f"\nOK{f' ({len(rep.warnings)} warning(s))' if rep.warnings else ''}: the configuration can launch.",
          file=out)
    if args.print_command and cmd is not None:
        print(shlex.join(cmd))
    return 0



def _feature_rows(rep: Report, run) -> None:
    """One row each for ``adaptive_load.ema`` / ``caption_dropout`` / ``validation`` when they are set."""
    al, parts = run.cfg.adaptive_load, run.profile.static_memory_parts(run.zero_stage, run.layout.world)
    if al.ema is not None:
        where = (f"{parts['ema']:.2f} GiB per GPU in the static memory above" if "ema" in parts else
                 "host memory (not in the GPU's static memory)")
        rep.row("ema", f"decay {al.ema.decay:g} every {al.ema.every} step(s), {al.ema.parameters} parameters: {where}",
                "ok")
    if al.caption_dropout is not None:
        rep.row("captions", f"caption dropout rate {al.caption_dropout.rate:g} ({al.caption_dropout.replace})", "ok")
    if run.validation is not None:
        rep.row("validation", f"{len(run.validation)} held-out samples, every {al.validation.every} steps x "
                              f"{al.validation.timesteps} timesteps; training plans {len(run.dataset)}", "ok")

if __name__ == "__main__":
    sys.exit(main())
