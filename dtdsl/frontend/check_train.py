"""The checker's cluster and train parts: the cluster's GPUs and links, the train block's
schedule, optimizer, synchronisation and learning-rate schedule."""

from __future__ import annotations

from typing import Any

from dtdsl.codes import DT204, DT205, DT208, DT307, DT501, DT633, DT637, DT638
from dtdsl.diagnostics import did_you_mean
from dtdsl.frontend import ast
from dtdsl.frontend.schema import (
    INVALID,
    head_span,
    resolve_call,
    resolve_fields,
)
from dtdsl.frontend.tables import (
    _CUSTOM_GPU,
    _GPU_OVERRIDES,
    _LR_SCHEDULE_ARGS,
    _OPTIMIZER_ARGS,
    _SCHEDULE_ARGS,
    _SYNC_ARGS,
    _SYNC_RULES,
    CLUSTER_FIELDS,
    TRAIN_FIELDS,
    _divisors,
    _field,
    _listing,
    _ok,
)
from dtdsl.ir import program as ir
from dtdsl.ir.hardware import GPU_PRESETS, HOST_BW_BYTES_PER_S


class TrainChecks:
    """``_Checker``'s cluster and train blocks (a mixin: ``self.ctx``)."""

    def _cluster(self, block: ast.ClusterBlock) -> Any:
        ctx = self.ctx
        head = head_span(block.span, len("cluster"))
        values = resolve_fields(block.fields, CLUSTER_FIELDS, ctx, "cluster", head)
        gpu_call = values["gpu"]
        gpu = INVALID
        preset = None
        if gpu_call is not INVALID:
            if gpu_call.func == "custom":
                args = resolve_call(gpu_call, _CUSTOM_GPU, ctx, "custom() gpu")
                if _ok(*args.values()):
                    gpu = ir.Gpu(name=args["name"], memory_bytes=int(args["memory"]),
                                 peak_flops=args["peak"])
            elif gpu_call.func in GPU_PRESETS:
                preset = GPU_PRESETS[gpu_call.func]
                args = resolve_call(gpu_call, _GPU_OVERRIDES, ctx, f"gpu {gpu_call.func}")
                if _ok(*args.values()):
                    gpu = ir.Gpu(name=gpu_call.func,
                                 memory_bytes=int(args["memory"] or preset.memory_bytes),
                                 peak_flops=args["peak"] or preset.peak_flops)
            else:
                guess = did_you_mean(gpu_call.func, GPU_PRESETS)
                ctx.error(DT205, f"unknown GPU '{gpu_call.func}'", gpu_call.func_span,
                          notes=["presets: " + ", ".join(GPU_PRESETS) +
                                 "; any other GPU: custom(memory=..., peak=...)"],
                          hint=f"did you mean '{guess}'?" if guess else None)
        for bw in ("intra_node_bw", "inter_node_bw"):
            if values[bw] is None and preset is None and gpu is not INVALID:
                values[bw] = ctx.error(DT204, f"cluster needs '{bw}' for a custom GPU",
                                       head, hint=f"add `{bw} = "
                                       f"{'400 GB/s' if bw.startswith('intra') else '400 Gb/s'}`")
        if not _ok(*values.values(), gpu):
            return INVALID
        gpus = values["gpus"]
        per_node = values["gpus_per_node"]
        if per_node is None:
            per_node = min(8, gpus)
        elif per_node > gpus:
            ctx.warning(DT501, f"gpus_per_node {per_node} is more than the cluster's {gpus} "
                        f"GPUs; dtdsl uses {gpus}", _field(block.fields, "gpus_per_node").span)
            per_node = gpus
        return ir.Cluster(
            name=block.name or "cluster", gpu=gpu, num_gpus=gpus, gpus_per_node=per_node,
            intra_node_bw_bytes_per_s=values["intra_node_bw"] or
            preset.intra_node_bw_bytes_per_s,
            inter_node_bw_bytes_per_s=values["inter_node_bw"] or
            preset.inter_node_bw_bytes_per_s,
            cpu_workers=values["cpu_workers"], span=block.span, gpus_span=self._gpus_span(block),
            host_bw_bytes_per_s=values["host_bw"] or HOST_BW_BYTES_PER_S)

    # ---- train -----------------------------------------------------------------------------
    def _train(self, block: ast.TrainBlock) -> Any:
        ctx = self.ctx
        values = resolve_fields(block.fields, TRAIN_FIELDS, ctx, "train",
                                head_span(block.span, len("train")))
        schedule, virtual = self._schedule(values["schedule"])
        optimizer = self._optimizer(values["optimizer"])
        lr_schedule = self._lr_schedule(values["lr_schedule"], optimizer, values["steps"],
                                        _field(block.fields, "steps") is not None)
        gb, mb = values["global_batch"], values["micro_batch"]
        if _ok(gb, mb) and gb % mb:
            f = _field(block.fields, "micro_batch")
            good = [d for d in _divisors(gb, 4096) if d <= max(mb * 4, 8)][-4:]
            ctx.error(DT307, f"global_batch {gb} is not divisible by micro_batch {mb}",
                      f.span if f else block.span,
                      hint=f"micro_batch must divide {gb}: e.g. {_listing(good)}")
            values["micro_batch"] = INVALID
        if values["async_tp"] is True and values["compile"] is False:
            f = _field(block.fields, "compile")
            ctx.error(DT638, "async_tp = true needs compiled blocks: inductor rewrites their "
                      "graphs to overlap TP's collectives, and compile = false leaves them "
                      "eager", f.span if f else block.span,
                      hint="remove compile = false (blocks compile on CUDA GPUs by default)")
            values["async_tp"] = INVALID
        sync = self._sync(values["sync"])
        if not _ok(*values.values(), schedule, virtual, optimizer, lr_schedule, sync):
            return INVALID
        spans = {f"{key}_span": f.span for key in ("schedule", "precision")
                 if (f := _field(block.fields, key)) is not None}
        values.update(schedule=schedule, virtual_stages=virtual, optimizer=optimizer,
                      lr_schedule=lr_schedule, sync=sync, span=block.span, **spans)
        return ir.Train(**values)

    def _schedule(self, call: ast.Call | None | Any) -> tuple[Any, Any]:
        ctx = self.ctx
        if call is None:
            return "1f1b", 1
        if call is INVALID:
            return INVALID, INVALID
        if call.func not in _SCHEDULE_ARGS:
            guess = did_you_mean(call.func, _SCHEDULE_ARGS)
            ctx.error(DT205, f"unknown schedule '{call.func}'", call.func_span,
                      notes=["schedules: gpipe, 1f1b, interleaved(virtual_stages=2), "
                             "zero_bubble"],
                      hint=f"did you mean '{guess}'?" if guess else None)
            return INVALID, INVALID
        args = resolve_call(call, _SCHEDULE_ARGS[call.func], ctx, f"{call.func} schedule", 1)
        if not _ok(*args.values()):
            return INVALID, INVALID
        return call.func, args.get("virtual_stages", 1)

    def _optimizer(self, call: ast.Call | None | Any) -> Any:
        ctx = self.ctx
        if call is None:  # the same as `optimizer = adamw`
            return ir.Optimizer(name="adamw", **{p.name: p.default for p in _OPTIMIZER_ARGS})
        if call is INVALID:
            return INVALID
        if call.func not in ("adamw", "adam"):
            guess = did_you_mean(call.func, ("adamw", "adam"))
            return ctx.error(DT205, f"unknown optimizer '{call.func}'", call.func_span,
                             notes=["optimizers: adamw, adam"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        args = resolve_call(call, _OPTIMIZER_ARGS, ctx, f"{call.func}()")
        if args["zero"] is not INVALID and args["zero"] > 1:
            return ctx.error(DT208, f"ZeRO stage {args['zero']} is not supported; dtdsl "
                             "shards optimizer state across data parallelism (stage 1), as "
                             "DistTrain does", call.arg_span("zero"),
                             hint="use zero=1 (or zero=0 to replicate optimizer state)")
        if not _ok(*args.values()):
            return INVALID
        if call.func == "adam":
            args["weight_decay"] = 0.0 if "weight_decay" not in \
                {a.name for a in call.args} else args["weight_decay"]
        return ir.Optimizer(name=call.func, **args)

    def _sync(self, call: ast.Call | None | Any) -> Any:
        """``sync = allreduce`` (the default) or ``sync = local_sgd(period=H | interval=T,
        outer_lr=..., outer_momentum=..., penalty=..., penalty_warmup=...,
        replica_dp=...)``."""
        ctx = self.ctx
        if call is None:
            return ir.Sync()
        if call is INVALID:
            return INVALID
        if call.func not in ("allreduce", "local_sgd"):
            guess = did_you_mean(call.func, ("allreduce", "local_sgd"))
            return ctx.error(DT205, f"unknown sync '{call.func}'", call.func_span,
                             notes=["sync: allreduce (every step), local_sgd(period=4, "
                                    "outer_lr=0.7, outer_momentum=0.9, penalty=false) or "
                                    "local_sgd(interval=30 s, ...)"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        args = resolve_call(call, _SYNC_ARGS if call.func == "local_sgd" else (),
                            ctx, f"{call.func}()")
        if call.func == "allreduce":
            return ir.Sync() if _ok(*args.values()) else INVALID
        checked = [self._sync_bound(call, args, *rule) for rule in _SYNC_RULES]
        if _ok(*args.values()) and args["period"] is not None and \
                args["interval"] is not None:
            checked.append(ctx.error(
                DT633, "local_sgd takes a period in steps or an interval in seconds, not "
                "both", call.arg_span("interval"),
                notes=[f"period={args['period']} syncs every {args['period']} steps; "
                       f"interval={args['interval']:g} s syncs when that much time has "
                       "passed (A-EDiT)"],
                hint="remove one of them"))
        if args["penalty"] is False and _ok(args["penalty_warmup"]) and \
                "penalty_warmup" in {a.name for a in call.args}:
            checked.append(ctx.error(
                DT637, f"local_sgd penalty_warmup={args['penalty_warmup']} without "
                "penalty=true: the penalty is off, so its warm-up would be ignored",
                call.arg_span("penalty_warmup"),
                hint="write penalty=true, or remove penalty_warmup"))
        if not _ok(*args.values(), *checked):
            return INVALID
        return ir.Sync(kind="local_sgd", period=args["period"] or 1,
                       interval_s=args["interval"], outer_lr=args["outer_lr"],
                       outer_momentum=args["outer_momentum"], penalty=args["penalty"],
                       penalty_warmup=args["penalty_warmup"], replica_dp=args["replica_dp"])

    def _sync_bound(self, call: ast.Call, args: dict[str, Any], name: str, code: str,
                    ok: Any, need: str, hint: str) -> Any:
        value = args[name]
        if value is INVALID or value is None or ok(value):
            return value
        return self.ctx.error(code, f"local_sgd {name} {value:g} {need}",
                              call.arg_span(name), hint=hint)

    def _lr_schedule(self, call: ast.Call | None | Any, optimizer: Any, steps: Any,
                     steps_given: bool) -> Any:
        """``lr_schedule = cosine(warmup=..., min_lr=...)``: the warmup must fit in the
        training steps and the decay must end at or below the optimizer's peak lr."""
        ctx = self.ctx
        if call is None:
            return ir.LRSchedule()
        if call is INVALID:
            return INVALID
        if call.func not in _LR_SCHEDULE_ARGS:
            guess = did_you_mean(call.func, _LR_SCHEDULE_ARGS)
            return ctx.error(DT205, f"unknown learning-rate schedule '{call.func}'",
                             call.func_span,
                             notes=["learning-rate schedules: constant(warmup=0), "
                                    "linear(warmup=0, min_lr=0), cosine(warmup=0, min_lr=0)"],
                             hint=f"did you mean '{guess}'?" if guess else None)
        args = resolve_call(call, _LR_SCHEDULE_ARGS[call.func], ctx, f"{call.func}()")
        warmup, min_lr = args["warmup"], args.get("min_lr", 0.0)
        if _ok(warmup, steps) and warmup > steps:
            default = "" if steps_given else " by default"
            warmup = ctx.error(DT208, f"a warmup of {warmup:,} steps is longer than the "
                               f"training: train.steps is {steps:,}{default}",
                               call.arg_span("warmup"),
                               notes=["the learning rate would never reach its peak"],
                               hint=f"warm up for at most {steps:,} steps, or raise steps")
        if _ok(min_lr, optimizer) and min_lr > optimizer.lr:
            min_lr = ctx.error(DT208, f"min_lr {min_lr:g} is above the peak learning rate: "
                               f"lr={optimizer.lr:g} of {optimizer.name}()",
                               call.arg_span("min_lr"),
                               notes=[f"{call.func}() decays from lr down to min_lr"],
                               hint=f"write a min_lr of at most {optimizer.lr:g} (0 by "
                               "default), or raise lr in the optimizer")
        if not _ok(warmup, min_lr):
            return INVALID
        return ir.LRSchedule(name=call.func, warmup=warmup, min_lr=min_lr)

    # ---- checks across blocks ----------------------------------------------------------------
