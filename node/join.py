"""`python -m node join`: start or join a swarm, claim a stage, serve it until stopped.

The composition root of a node: the DHT (node.swarm), the run record and the model hash check,
the stage claim, the stage's weights (node.model), the outer sync (node.dp) and the runtime
(node.runtime), in the order a start needs them. (Just over 400 lines: each phase is a short
function, and a start reads top to bottom in one place.)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shlex
import sys
import time
import zlib

import torch
from hivemind import DHT
from hivemind.p2p import P2P

from node.argv import FlagError
from node.config import NodeConfig, run_parts, stage_layers
from node.dp.deferred import DeferredOuter
from node.dp.diloco import OuterSync
from node.inputs import (
    check_announce,
    check_identity,
    check_ip,
    check_new_file,
    check_run_id,
    check_state_dir,
)
from node.model.adapters import (
    AdapterError,
    adapter_params,
    add_adapters,
    base_dtype,
    frozen_base,
    frozen_bytes_per_param,
    quantize_base,
    targets_of,
)
from node.model.checkpoint import newest_for_run
from node.model.data import ByteTokenizer, DataError, as_plain_text, check_data, load_examples, microbatches
from node.model.devices import (
    GIB,
    describe_memory,
    keep_large_blocks_returnable,
    pick_device,
    return_freed_memory,
    stage_memory_bytes,
)
from node.model.loading import (
    ModelError,
    ModelSource,
    check_model,
    combine_hashes,
    open_model,
    open_pretrain_model,
)
from node.model.stages import default_stage_ranges
from node.net.reach import ask_many, decide
from node.net.wire import Wire
from node.runtime import StageRuntime
from node.stage.basis import (
    BASIS_VERSION,
    BasisStore,
    BasisUnavailable,
    calibrate_rotations_stagewise,
    calibrate_stagewise,
)
from node.stage.heldout import training_examples
from node.stage.links import build_codec, codec_settings
from node.stop_signal import StopRequest
from node.swarm.membership import (
    JoinError,
    check_peer_addresses,
    keep_run_record,
    publish_run_record,
    read_run_record,
    read_stage_records_sync,
    remove_socket_dir,
    socket_dir,
    start_dht,
    store_stage_record,
    store_stage_record_sync,
)
from node.swarm.reverse import dialback_questions
from node.swarm.routing import choose_stage, relays_of, unreachable_neighbour
from protocol.auth import SwarmKeyError, key_id, load_swarm_key
from protocol.records import RunRecord, StageRecord

log = logging.getLogger("node")


def run_stages(cfg: NodeConfig, model) -> list[list[int]]:
    """A new run's layer ranges: ``--stage-layers`` as given, else balanced by estimated cost."""
    if not cfg.stage_layers:
        return default_stage_ranges(model, cfg.stages)
    try:
        ranges = stage_layers(cfg.stage_layers, model.config.num_hidden_layers)
    except ValueError as e:
        raise JoinError(f"--stage-layers {e}") from None
    if len(ranges) != cfg.stages:
        raise JoinError(
            f"--stage-layers gives {len(ranges)} ranges for --stages {cfg.stages}: give one range per stage"
        )
    return ranges


def new_run_record(cfg: NodeConfig, model, name: str, model_hash: str) -> RunRecord:
    return RunRecord(
        run_id=cfg.run_id,
        model_name=name,
        model_hash=model_hash,
        num_layers=model.config.num_hidden_layers,
        hidden=model.config.hidden_size,
        stages=run_stages(cfg, model),
        codec=codec_settings(cfg, model),
        **run_parts(cfg),  # the typed parts and the scalars, field by field (node.config)
        # a tied model stays tied across stages: head and tail sum their gradients (node.dp.tied);
        # under LoRA the tied tensor is frozen, so the copies stay equal with nothing to exchange
        tied=bool(getattr(model.config, "tie_word_embeddings", False)) and cfg.finetune == "full",
    )


def load_run_model(cfg: NodeConfig, run: RunRecord | None) -> ModelSource:
    """The model this node serves, as the run says (joiners) or as the flags say (the starter).

    Only the config of a checkpoint is read here: the node claims a stage by its estimated
    memory first and then loads that stage's tensors (``ModelSource.load_stage``).
    ``--mode pretrain`` builds a fresh Llama from a config and the run seed (with the subspace
    constraint when the run's codec is ``subspace``); every peer builds the same bits, which the
    content hashes then confirm.
    """
    mode = cfg.mode if run is None else run.mode
    seed = cfg.seed if run is None else run.seed
    if mode == "pretrain":
        codec = {"codec": cfg.codec, "k": cfg.subspace_rank} if run is None else run.codec
        k = int(codec.get("k", 0)) if codec.get("codec") == "subspace" else 0
        return open_pretrain_model(cfg.model, seed=seed, subspace_k=k)
    return open_model(cfg.model, seed=seed)


def needs_basis(run: RunRecord) -> bool:
    """Codecs with fitted state calibrated at run start: a basis of ``k`` directions (pca; pcamask's
    pool), or the tiered codec's two rotations."""
    return run.codec.get("codec") in ("pca", "pcamask", "tiered")


def calibrate_bases(cfg: NodeConfig, run: RunRecord, source: ModelSource, tok, stop: StopRequest) -> list:
    """Basis payloads (version 1) of every boundary, from the run's data through the pretrained
    model, loaded one stage at a time (fp32 on the CPU, as the whole model was)."""
    tok = tok or ByteTokenizer(source.config.vocab_size)
    examples = load_examples(cfg.data, seed=run.seed)
    batches = microbatches(
        examples, tok, run.microbatch, run.seq_len, seed=run.seed, max_tokens=run.microbatch_tokens
    )
    t0 = time.monotonic()
    log.info("calibrating the link bases of %d boundaries (once per run)...", len(run.stages) - 1)

    def load(i: int):
        stop.check()  # calibrating a big model takes minutes: a stop request waits one stage at most
        return source.load_stage(run.stages, i, torch.device("cpu"), torch.float32)

    pad = tok.eos_token_id or 0
    payloads = []
    if run.codec.get("codec") == "tiered":  # a rotation of the activations and one of the gradients
        for r_fwd, r_bwd in calibrate_rotations_stagewise(
            load, run.stages, batches, pad_id=pad, max_tokens=cfg.calibration_tokens
        ):
            codec = build_codec(run.codec)
            codec.set_rotations(r_fwd, r_bwd, BASIS_VERSION)
            payloads.append(codec.basis_payload())
    else:
        for mean, v in calibrate_stagewise(
            load, run.stages, batches, k=run.codec["k"], pad_id=pad, max_tokens=cfg.calibration_tokens
        ):
            codec = build_codec(run.codec)
            codec.set_basis(mean, v, BASIS_VERSION)
            payloads.append(codec.basis_payload())
    log.info("bases ready in %.1fs", time.monotonic() - t0)
    return payloads


def stage_memory(cfg: NodeConfig, run: RunRecord, model, device) -> list[dict[str, int]]:
    """Memory estimate of every stage of the run on this node's device."""
    layers = model.model.layers
    lora = run.finetune.mode == "lora"
    nf4 = lora and cfg.base_dtype == "nf4"
    outer = run.outer.every > 0 and run.dp.mode == "diloco" and cfg.circuit == "fast"
    c = model.config
    mlp = getattr(c, "intermediate_size", None)
    heads = getattr(c, "num_attention_heads", None)
    head_dim = getattr(c, "head_dim", None) or (c.hidden_size // heads if heads else None)
    kv = head_dim * getattr(c, "num_key_value_heads", heads) if head_dim else None
    out = []
    for i, (start, end) in enumerate(run.stages):
        n = sum(p.numel() for layer in layers[start:end] for p in layer.parameters())
        if i == 0:
            n += sum(p.numel() for p in model.get_input_embeddings().parameters())
        is_tail = i == len(run.stages) - 1
        if is_tail:
            n += model.get_output_embeddings().weight.numel()
        trainable = adapter_params(layers[start:end], run.finetune) if lora else None
        frozen = frozen_bytes_per_param(layers[start:end], n, cfg.base_dtype, device) if lora else None
        out.append(
            stage_memory_bytes(
                n,
                end - start,
                run.hidden,
                model.config.vocab_size if is_tail else None,
                run.max_frame_tokens,
                cfg.max_inflight,
                device,
                n_adapters=trainable,
                base_bytes=frozen,
                outer=outer,
                recompute=cfg.recompute_layers,
                mlp=mlp,
                kv=kv,
                # an NF4 stage is read on the host at its compute dtype, then quantized onto the device
                staged=n * torch.finfo(base_dtype("nf4", device)).bits // 8 if nf4 else 0,
            )
        )
    return out


def stages_that_fit(cfg: NodeConfig, mem: list[dict[str, int]], on_cpu: bool = False) -> set[int]:
    """The stages whose estimate fits --max-memory (the device) and --max-host-memory (the host's
    own buffers, plus the device's share when the device is the CPU: one RAM)."""
    fits = set(range(len(mem)))
    if cfg.max_memory_gb:
        fits = {i for i in fits if mem[i]["total"] <= cfg.max_memory_gb * GIB}
    if cfg.max_host_memory_gb:
        fits = {
            i
            for i in fits
            if mem[i].get("host", 0) + (mem[i]["total"] if on_cpu else 0) <= cfg.max_host_memory_gb * GIB
        }
    return fits


def claim_stage(
    cfg: NodeConfig,
    dht,
    run: RunRecord,
    peer_id: str,
    fits: set[int] | None = None,
    reachability: str = "direct",
) -> int:
    """The stage this node serves, claimed in the DHT at once (not ready yet). Behind NAT
    (``reachability`` nat) it refuses a stage next to one served only by nodes behind NAT."""
    n = len(run.stages)
    fits = set(range(n)) if fits is None else fits
    behind_nat = reachability == "nat"
    records = read_stage_records_sync(dht, run.run_id, n)
    for stage in records:  # a restarted node's record from its last life is not a live replica
        stage.pop(peer_id, None)
    limits = " and ".join(
        f"{flag} {gb:g} GiB"
        for flag, gb in (("--max-memory", cfg.max_memory_gb), ("--max-host-memory", cfg.max_host_memory_gb))
        if gb
    )
    if not fits:
        raise JoinError(
            f"no stage of this run fits in {limits}; join a run with more stages or --finetune lora, "
            "raise the limit, or use a machine with more memory"
        )
    if cfg.stage != "auto":
        index = int(cfg.stage)
        if not 0 <= index < n:
            raise JoinError(f"--stage {index} does not exist: this run has stages 0..{n - 1}")
        if index not in fits:
            raise JoinError(f"stage {index} does not fit in {limits}; stages that fit: {sorted(fits)}")
    else:
        served = {i for i in fits if unreachable_neighbour(records, i, peer_id, cfg.circuit) is None}
        index = choose_stage(records, cfg.circuit, allowed=served if behind_nat and served else fits)
    cut = unreachable_neighbour(records, index, peer_id, cfg.circuit) if behind_nat else None
    if cut is not None and not relays_of(records, peer_id):
        raise JoinError(
            f"this node is behind NAT and so is every node of stage {cut}, next to stage {index}, and "
            "no reachable node of the run relays: no frame could cross. Forward a TCP port on your "
            "router to this machine (--port P --host 0.0.0.0 --announce-maddr /ip4/PUBLIC_IP/tcp/P "
            f"--reachability direct), or join when a reachable node serves stage {cut} or relays"
        )
    if cut is not None:
        log.info("stage %d is served only from behind NAT: frames to it go through a relay", cut)
    # publish the claim at once (not ready yet) so the next joiner sees this stage as taken
    reach = "reverse" if behind_nat else "direct"
    store_stage_record_sync(
        dht, run.run_id, index, peer_id, StageRecord(circuit=cfg.circuit, ready=False, reach=reach)
    )
    return index


def find_reachability(cfg: NodeConfig, dht, run: RunRecord | None, maddrs: list[str], key) -> str:
    """``direct`` or ``nat`` (node.net.reach.decide): with ``--reachability auto``, up to five peers
    (the bootstrap peers first, then ready peers of the run) are asked to dial ``maddrs`` back."""
    if cfg.reachability != "auto" or not cfg.peers:
        mode, why = decide(cfg.reachability, [], bool(cfg.peers))
        log.info("reachability: %s (%s)", mode, why)
        return mode
    known: dict[str, list[str]] = {}  # peer id -> the addresses we know it by
    for p in cfg.peers:
        addr, _, peer = p.rpartition("/p2p/")
        known.setdefault(peer, []).append(addr)
    if run is not None:
        for stage in read_stage_records_sync(dht, run.run_id, len(run.stages)):
            for p, r in sorted(stage.items()):
                if r.ready and p not in known:
                    known[p] = r.maddrs
    known.pop(dht.peer_id.to_base58(), None)
    questions = dialback_questions(known, maddrs)

    async def ask() -> list:
        # a replica of the DHT's daemon, for these few streams only (the node's own comes later,
        # in its serving loop; hivemind's cached replica would be bound to this loop)
        p2p = await P2P.replicate(dht.run_coroutine(DHT._get_p2p_daemon_listen_maddr))
        try:
            return await ask_many(p2p, Wire(key), questions, cfg.run_id)
        finally:
            await p2p.shutdown()

    answers = asyncio.run(ask())
    mode, why = decide("auto", answers, True)
    log.info("reachability: %s (%s)", mode, why)
    if mode == "nat":
        print(
            f"this node is behind NAT or a firewall ({why}): it dials the peers that send it work and "
            "keeps those connections open; forwarding a TCP port is optional (--reachability direct)",
            flush=True,
        )
    return mode


def join_command(peer_id: str, maddrs: list[str], run_id: str, model: str = NodeConfig.model) -> str:
    """The command others paste. It carries ``--model``: a joiner builds the run's model from the
    same spec (the run record holds only its display name and hash), the rest comes from the DHT."""
    peers = " ".join(a for a in maddrs if "/p2p/" in a) or " ".join(f"{a}/p2p/{peer_id}" for a in maddrs)
    extra = f" --run-id {shlex.quote(run_id)}" if run_id != "default" else ""
    extra += f" --model {shlex.quote(model)}" if model != NodeConfig.model else ""
    return f"python -m node join --peers {peers}{extra}"


NEW_RUN_CHECK_S = 3.0  # --new-run: how long to look for an existing record of the run id


def find_run(cfg: NodeConfig, dht, stop: StopRequest) -> RunRecord | None:
    """The run to join (None: this node starts it). Refuses in one line what cannot be meant."""
    if not cfg.peers:
        return None
    if cfg.new_run:  # a run on a DHT that others share (a plain hivemind bootstrap, another run's swarm)
        if read_run_record(dht, cfg.run_id, NEW_RUN_CHECK_S, stop.check) is not None:
            raise JoinError(
                f"--new-run: run {cfg.run_id!r} already exists in the swarm at {cfg.peers[0]}; join it "
                "without --new-run, or start another run with a different --run-id"
            )
        return None
    run = read_run_record(dht, cfg.run_id, cfg.join_timeout, stop.check)
    if run is None:
        raise JoinError(
            f"no run {cfg.run_id!r} found in the swarm at {cfg.peers[0]} within "
            f"{cfg.join_timeout:.0f}s; check --run-id, pass --new-run to start this run on that DHT, "
            "or start a new swarm without --peers"
        )
    return run


def check_inputs(cfg: NodeConfig) -> None:
    """What the flags name, checked before any daemon, socket or model load: the stage of a new run,
    the model (a Hub id is fetched here; a partial snapshot refused), the data file, the swarm key.
    Each failure is one line (JoinError, ModelError, DataError, SwarmKeyError, FlagError). Then the
    paths and addresses: a state directory, identity key or metrics file that cannot be written or
    read, a malformed peer, listen or announce address, failed later as an exception's name after
    p2pd had started (or, the metrics file, once the node served)."""
    if not cfg.peers and cfg.stage != "auto" and int(cfg.stage) >= cfg.stages:
        raise JoinError(
            f"--stage {cfg.stage} does not exist: a new run of --stages {cfg.stages} has stages "
            f"0..{cfg.stages - 1}"
        )
    # a joiner learns the run's mode from its record: a pretrain run needs only a config.json
    check_model(cfg.model, cfg.mode if not cfg.peers or cfg.new_run else None)
    check_data(cfg.data)  # any node may come to serve the head (--stage auto, a move)
    if cfg.swarm_key:
        load_swarm_key(cfg.swarm_key)
    check_run_id(cfg.run_id)
    check_peer_addresses(cfg.peers)
    check_announce(cfg.announce_maddrs)
    check_ip("--host", cfg.host, v4_only=True)
    if cfg.dashboard:
        check_ip("--dashboard-host", cfg.dashboard_host, v4_only=False)
    check_state_dir(cfg.state_dir)
    check_identity(cfg.identity, cfg.state_dir)
    for flag, path in (("--metrics-file", cfg.metrics_file), ("--ready-file", cfg.ready_file)):
        if path:
            check_new_file(flag, path, may_exist=True)


def check_lora_targets(ft, model: torch.nn.Module) -> None:
    """A new run's --lora-targets against the model's linear layers (the stages check it again)."""
    present = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    if not set(targets_of(ft)) & present:
        raise AdapterError(
            f"--lora-targets {ft.targets!r} names no linear layer of this model (it has: "
            f"{', '.join(sorted(present))}); pass some of those names, comma-separated"
        )


def run_join(cfg: NodeConfig) -> int:
    try:
        check_inputs(cfg)
    except (JoinError, ModelError, DataError, SwarmKeyError, FlagError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    # Until the event loop takes over signals, SIGTERM / Ctrl-C unwind through the cleanup below
    # (DHT process, p2pd, socket dir) at the next phase boundary (node/stop_signal.py says why
    # not where the signal lands) instead of killing the process where it stands.
    stop = StopRequest()
    stop.install()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    keep_large_blocks_returnable()  # before the first weight is loaded (node.model.devices says why)
    device = pick_device(cfg.device)
    key = load_swarm_key(cfg.swarm_key) if cfg.swarm_key else None  # checked above
    sockdir = socket_dir(cfg.run_id)
    dht = outer = None
    try:
        log.info("starting p2pd and the DHT%s", f" (bootstrap: {' '.join(cfg.peers)})" if cfg.peers else "")
        dht = start_dht(cfg)
        stop.check()
        peer_id = dht.peer_id.to_base58()
        maddrs = [str(a) for a in dht.get_visible_maddrs()]
        run = find_run(cfg, dht, stop)
        source = load_run_model(cfg, run)  # config only: weights wait for the claimed stage
        model, tok, name = source.skeleton, source.tokenizer(), source.name
        run_is_new = run is None
        if run is None:
            run = new_run_record(cfg, model, name, "")
            if run.finetune.mode == "lora":  # before the record is published: no run that cannot train
                check_lora_targets(run.finetune, model)
            run.model_hash, run.stage_hashes = source.run_hashes(run.stages)  # streamed, tensor by tensor
            run.key_id = key_id(key) if key else ""
            publish_run_record(dht, run)
            print(f"started swarm {run.run_id!r}: {name}, {len(run.stages)} stages {run.stages}", flush=True)
            print(f"others join with:\n  {join_command(peer_id, maddrs, run.run_id, cfg.model)}", flush=True)
        elif run.key_id and (key is None or key_id(key) != run.key_id):
            raise JoinError(
                "this swarm only accepts nodes holding its swarm key: pass --swarm-key FILE "
                "(the key file from the swarm's operator)"
                if key is None
                else "--swarm-key is not this swarm's key (fingerprints differ); ask its operator"
            )
        elif combine_hashes(source.config_hash(), run.stage_hashes) != run.model_hash:
            raise JoinError(
                f"this node's model ({name}, config {source.config_hash()[:12]}) differs from the run's "
                f"({run.model_name}, {run.model_hash[:12]}); pass the --model of the join command the "
                "swarm's first node printed"
            )
        bases = None
        if needs_basis(run):
            bases = BasisStore(run.run_id, dht, peer_id, timeout=cfg.join_timeout)
            if run_is_new:  # the starter calibrates every boundary, one stage of the model at a time
                for b, payload in enumerate(calibrate_bases(cfg, run, source, tok, stop)):
                    bases.add(b, payload)
                publish_run_record(dht, run)  # calibrating may outlast its lifetime
        # a node that chose its stage itself may move later; --stage N pins it (a resumed node
        # goes back to its checkpoint's stage first, and may move from there)
        may_move = cfg.rebalance and cfg.stage == "auto" and cfg.circuit == "fast"
        resume_from = None
        if cfg.resume:
            resume_from = newest_for_run(cfg.state_dir, run.run_id)
            if resume_from is None:
                log.warning(
                    "--resume: no complete checkpoint of run %s in %s; starting fresh",
                    run.run_id,
                    cfg.state_dir,
                )
            elif cfg.stage == "auto":
                cfg.stage = str(resume_from.counters["stage"])  # back to the stage the checkpoint holds
        if cfg.base_dtype != "auto" and run.finetune.mode != "lora":
            raise JoinError(
                f"--base-dtype {cfg.base_dtype} applies to a --finetune lora run (a frozen base under "
                "adapters); this run trains every weight in fp32: leave --base-dtype out"
            )
        mem = stage_memory(cfg, run, model, device)
        fits = stages_that_fit(cfg, mem, on_cpu=device.type == "cpu")
        stop.check()
        reachability = find_reachability(cfg, dht, None if run_is_new else run, maddrs, key)
        stop.check()
        index = claim_stage(cfg, dht, run, peer_id, fits, reachability)
        del model
        return_freed_memory()  # what hashing, calibrating and the skeleton freed, before the stage loads

        def start_stage(index: int, resume_from=None) -> StageRuntime:
            """Load stage ``index`` and build its runtime (at the start, and again after a move)."""
            nonlocal outer, tok
            if not run_is_new and source.stage_hash(run.stages, index) != run.stage_hashes[index]:
                raise JoinError(
                    f"this node's weights of stage {index} differ from the run's (hash mismatch); "
                    "pass the same --model checkpoint as the swarm, or download it again"
                )
            start, end = run.stages[index]
            print(
                f"peer {peer_id} serves stage {index} (layers {start}..{end - 1}) on {device}, "
                f"needs {describe_memory(mem[index])}",
                flush=True,
            )
            if cfg.ready_file:
                with open(cfg.ready_file + ".tmp", "w") as f:
                    # the codec as the run record has it (k clamped to the model's width): what the
                    # links use, for the launcher's report
                    json.dump({"peer_id": peer_id, "maddrs": maddrs, "stage": index, "codec": run.codec}, f)
                os.replace(cfg.ready_file + ".tmp", cfg.ready_file)
            if run.finetune.mode == "lora":
                # the base read at its own dtype (never an fp32 copy of a bf16 base on the GPU); an
                # NF4 one on the host first, its linear weights moved to the device as they are quantized
                compute, nf4 = base_dtype(cfg.base_dtype, device), cfg.base_dtype == "nf4"
                stage = source.load_stage(run.stages, index, torch.device("cpu") if nf4 else device, compute)
                n = add_adapters(stage, run.finetune, run.seed)  # fp32 adapters over the base
                if nf4:
                    quantize_base(stage, compute, device)
                    stage.to(device)
                trained = sum(p.numel() for p in stage.parameters() if p.requires_grad)
                log.info("stage %d: %d LoRA adapters (%d trainable parameters)", index, n, trained)
            else:
                stage = source.load_stage(run.stages, index, device)
            stage.recompute = cfg.recompute_layers

            def starting_weights() -> dict[str, torch.Tensor]:
                """The stage's trained tensors as loaded above, before any step (on the CPU, in fp32)."""
                fresh = source.load_stage(run.stages, index, torch.device("cpu"))
                if run.finetune.mode == "lora":
                    add_adapters(fresh, run.finetune, run.seed)  # seeded: the same adapters as above
                return {n: p.detach() for n, p in fresh.named_parameters() if p.requires_grad}

            stop.check()
            data = None
            if index == 0:
                tok = tok or ByteTokenizer(stage.config.vocab_size)
                examples = load_examples(cfg.data, seed=run.seed)
                # --eval-every: the examples a tail scores as held out are never drawn here
                examples = training_examples(examples, run.seed, cfg.eval_every)
                if run.mode == "pretrain":  # next-token loss on every position
                    examples = as_plain_text(examples)
                seed = zlib.crc32(peer_id.encode())
                data = microbatches(
                    examples, tok, run.microbatch, run.seq_len, seed=seed, max_tokens=run.microbatch_tokens
                )
            outer = deferred = None
            if run.outer.every > 0 and cfg.circuit == "fast":
                o = run.outer

                def build_outer(theta0=None) -> OuterSync:
                    nonlocal outer  # the cleanup below shuts its helper down, built now or later
                    # hivemind's averager installs signal handlers: it must be created on the main thread
                    outer = OuterSync(
                        dht,
                        run.run_id,
                        index,
                        {n: p for n, p in stage.named_parameters() if p.requires_grad},
                        rank=o.rank,
                        bits=o.bits,
                        group_size=o.group_size,
                        outer_lr=o.lr,
                        momentum=o.momentum,
                        seed=run.seed,
                        timeout=o.timeout,
                        mode=o.mode,
                        theta0=theta0,
                        wire_key=key,  # the relay handshake of its streams to NAT'd replicas
                    )
                    return outer

                # alone on the stage (and no outer state to resume): no rounds run, so the outer
                # state is built when a partner first appears (node.dp.deferred says why), from
                # starting weights read again from the model's files (an in-memory model has no
                # other copy of them: it builds the state now)
                partners = [
                    p for p, r in read_stage_records_sync(dht, run.run_id, len(run.stages))[index].items()
                    if p != peer_id and r.circuit == "fast"
                ]  # fmt: skip
                resumes_outer = resume_from is not None and "outer" in resume_from.extra_states
                if partners or resumes_outer or run.dp.mode != "diloco" or not source.reloads_weights:
                    build_outer()
                else:
                    deferred = DeferredOuter(starting_weights, build_outer)
            stop.check()  # outer is set: the cleanup below shuts its helper down
            runtime = StageRuntime(
                cfg, run, index, stage, dht, peer_id, data, device, outer=outer, deferred_outer=deferred
            )
            runtime.stop_request = stop
            runtime.maddrs = maddrs
            runtime.reachability = reachability
            runtime.base = frozen_base(stage)
            runtime.memory_estimate = mem[index]
            if resume_from is not None:
                runtime.restore(resume_from)
                log.info("resumed from %s at inner step %d", resume_from.path, runtime.inner_step)
            runtime.wire = Wire(key)
            runtime.bases = bases
            runtime.move_allowed = fits if may_move else None
            return runtime

        runtime = start_stage(index, resume_from)

        async def main():
            nonlocal runtime, outer
            p2p = await dht.replicate_p2p()
            keeper = asyncio.create_task(keep_run_record(dht, run, asyncio.Event()))
            try:
                while True:
                    await runtime.serve(p2p)
                    if runtime.move_to is None or runtime.terminated:
                        return
                    # moved (node.swarm.rebalance): the same DHT and p2p serve the new stage, after a claim
                    # that others see at once, so no second replica moves there too
                    if outer is not None:
                        outer.shutdown()
                    left, index = runtime, runtime.move_to
                    await store_stage_record(
                        dht, run.run_id, index, peer_id, StageRecord(circuit=cfg.circuit, ready=False),
                        timeout=cfg.hop_timeout,
                    )  # fmt: skip
                    runtime = start_stage(index)
                    if left.terminated:  # SIGTERM while the new stage loaded (the old handler caught it)
                        return
            finally:
                keeper.cancel()

        try:
            import uvloop

            uvloop.run(main())
        except ImportError:  # uvloop is pinned, but the node still works without it
            asyncio.run(main())
        log.info("stopped after %d inner steps", runtime.inner_step)
        return 0
    except (JoinError, BasisUnavailable, ModelError, DataError, AdapterError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    except KeyboardInterrupt:
        print("interrupted before the node started serving; cleaned up", file=sys.stderr, flush=True)
        return 130
    finally:
        if outer is not None:
            with contextlib.suppress(Exception):
                outer.shutdown()
        if dht is not None:
            t0 = time.monotonic()
            try:
                dht.shutdown()
            except Exception:
                pass
            if dht.is_alive():
                dht.terminate()
            log.debug("DHT stopped in %.1fs", time.monotonic() - t0)
            os.close(dht.identity_lock)
        remove_socket_dir(sockdir)
