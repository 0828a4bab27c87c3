"""`stoker keys SPEC|NAME list|add [KEY]|revoke KEY-OR-DIGEST`: a deployment's API keys, changed without a run.

The keys live where the spec's deploy.api_keys says (a file, or a Prefect Secret block); the running proxy holds
only their sha256 digests. ``add`` appends a key (generated unless given; a generated one is printed once) and
``revoke`` removes one, named by the whole key or by a digest prefix as ``list`` prints it. Either then pushes the
source's digests to the running proxy through its runtime API (stoker.serving.api_keys.sync: atomic, no restart)
and into its state folder (what a restarted proxy reads), so the change holds within seconds. ``list`` prints
digest prefixes and the count, never a key, and whether the running proxy accepts that same set.

SPEC or NAME: as for `stoker reconcile` (the spec file, or the spec of the deployment's newest run on this host):
the source of the keys is in the spec, not in the proxy's state.
"""

from __future__ import annotations

import time

from ..errors import StokerError

SHOWN = 12  # digest characters printed: enough to tell keys apart and to name one to revoke


def keys_file() -> str:
    """The digests' file as the proxy sees it (stoker.serving.deployment.keys_file)."""
    from ..serving import api_keys, haproxy

    return f"{haproxy.MOUNT}/{api_keys.DIGESTS_NAME}"


class KeysError(StokerError):
    """No keys in the spec, no proxy to push to, or a change that would lock every client out."""


def _proxy(spec, then: str = ": nothing changed"):
    """The running proxy's admin socket and state folder; one line (ending in ``then``) when there is none that
    checks keys."""
    from ..run import stoker_home
    from ..serving import haproxy

    name = spec.deploy.name
    # A revoke's seconds are mostly this process's start, and importing Docker's client is most of that: a proxy
    # that answers in this home's state folder and knows the key list is the deployment's, running. Otherwise
    # (a worker's own STOKER_HOME, a stopped proxy) Docker says where its folder is, or why there is none.
    state_dir = stoker_home() / "proxy" / name
    try:
        answer = haproxy.command(haproxy.Runtime(state_dir).sock, f"show acl {keys_file()}")
    except haproxy.ProxyApiError:
        answer = "Unknown"
    if "Unknown" not in answer:
        return haproxy.Runtime(state_dir).sock, state_dir
    from ..containers import engine

    found = engine.containers(engine.connect(spec.deploy.docker_host), name, role=engine.ROLE_PROXY)
    c = found[0] if found else None
    if c is None or c.status != "running":
        raise KeysError(f"no running proxy for deployment {name}{then} (`stoker reconcile SPEC` starts it; "
                        "`stoker status` shows what runs)")
    if "keys" not in c.labels.get(engine.LABEL_FRONT, "open").split(","):
        raise KeysError(f"the proxy of {name} asks no API key (it was deployed without deploy.api_keys){then}; "
                        "`stoker reconcile SPEC` applies the spec's keys")
    state_dir = engine.state_mount(c, haproxy.MOUNT) or stoker_home() / "proxy" / name
    return haproxy.Runtime(state_dir).sock, state_dir


def _push(spec, text: str, sock, state_dir) -> tuple[int, bool]:
    """The source's digests to the proxy's state folder, then to the running proxy; (count, whether it changed)."""
    from ..serving import api_keys

    keyset = api_keys.parse(text, api_keys.source_name(spec.deploy.api_keys))
    api_keys.publish(state_dir, keyset)
    return len(keyset), api_keys.sync(sock, keys_file(), keyset)


def list_keys(spec) -> list[str]:
    from ..serving import api_keys

    source = spec.deploy.api_keys
    digests = sorted({api_keys.digest(k) for k in api_keys.keys_of(api_keys.read_source(source))})
    lines = [f"{len(digests)} key(s) in {api_keys.source_name(source)}:", *(f"  {d[:SHOWN]}" for d in digests)]
    try:
        sock, _ = _proxy(spec, then="")
        proxy = api_keys.accepted(sock, keys_file())
    except StokerError as err:
        return [*lines, f"proxy: {err}"]
    agree = "the same set" if proxy == set(digests) else \
        f"a different set of {len(proxy)} (`stoker keys SPEC` add/revoke or `stoker reconcile SPEC` pushes these)"
    return [*lines, f"the running proxy of {spec.deploy.name} accepts {agree}"]


def add(spec, key: str | None) -> list[str]:
    from ..serving import api_keys

    source = spec.deploy.api_keys
    generated = key is None
    if key == "-":  # from stdin: not in the shell's history or the process list
        import sys

        key = sys.stdin.readline().strip()
    key = api_keys.generate() if generated else key
    api_keys.check_key(key)
    sock, state_dir = _proxy(spec)  # before the source changes: no proxy, no change
    t0 = time.perf_counter()
    with api_keys.edit_lock(source):
        text = api_keys.read_source(source)
        if key in api_keys.keys_of(text):
            raise KeysError(f"that key is already in {api_keys.source_name(source)}: nothing changed")
        new = api_keys.with_key(text, key)
        api_keys.parse(new, api_keys.source_name(source))  # the whole list still valid (count, entries)
        api_keys.write_source(source, new)
    n, _ = _push(spec, new, sock, state_dir)
    done = (f"added key {api_keys.digest(key)[:SHOWN]} to {api_keys.source_name(source)}; the proxy of "
            f"{spec.deploy.name} accepts {n} key(s) ({time.perf_counter() - t0:.1f} s, no restart)")
    # A generated key exists nowhere else readable: this is the one time it is shown.
    return [key, f"{done}; the key above is shown once"] if generated else [done]


def revoke(spec, which: str) -> list[str]:
    from ..serving import api_keys

    source = spec.deploy.api_keys
    sock, state_dir = _proxy(spec)
    t0 = time.perf_counter()
    with api_keys.edit_lock(source):
        text = api_keys.read_source(source)
        gone = api_keys.select(api_keys.keys_of(text), which)
        new = api_keys.without(text, gone)
        if not api_keys.keys_of(new):
            raise KeysError(f"that is the last key of {spec.deploy.name}: nothing changed (add another first; to "
                            "serve without keys, remove deploy.api_keys from the spec and `stoker reconcile SPEC`)")
        api_keys.write_source(source, new)
    n, _ = _push(spec, new, sock, state_dir)
    names = ", ".join(api_keys.digest(k)[:SHOWN] for k in sorted(gone))
    return [f"revoked key {names} from {api_keys.source_name(source)}; the proxy of {spec.deploy.name} refuses it "
            f"and accepts {n} key(s) ({time.perf_counter() - t0:.1f} s, no restart)"]


def _handler(args) -> int:
    from .reconcile import deploy_lock_held, spec_of

    spec = spec_of(args.spec)
    if spec.deploy.api_keys is None:
        raise KeysError(f"deployment {spec.deploy.name}'s spec asks no API key (deploy.api_keys): no keys to "
                        f"{args.action}")
    if args.action == "list":
        lines = list_keys(spec)
    else:
        if args.action == "revoke" and not args.key:
            raise KeysError("stoker keys SPEC revoke needs the key, or its digest prefix from `stoker keys SPEC list`")
        # A run's reconcile pushes the keys too: one of them at a time, so neither pushes a list the other replaced.
        with deploy_lock_held(spec.deploy.name):
            lines = add(spec, args.key) if args.action == "add" else revoke(spec, args.key)
    for line in lines:
        print(line)
    return 0


def register(sub) -> None:
    p = sub.add_parser("keys", help="list, add or revoke a deployment's API keys; effective at once, no run")
    p.add_argument("spec", metavar="SPEC|NAME", help="the spec file (its deploy.api_keys is the keys' source), or "
                                                      "deploy.name (the spec of its newest run on this host)")
    p.add_argument("action", choices=("list", "add", "revoke"))
    p.add_argument("key", nargs="?", default=None, metavar="KEY",
                   help="add: the key, or - to read it from stdin (default: a generated one, printed once); revoke: the key or a digest prefix "
                        "(8+ hex characters, as list prints it)")
    p.set_defaults(fn=_handler)
