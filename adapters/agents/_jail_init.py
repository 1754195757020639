"""The first program inside an agent's namespace sandbox (adapters/agents/jail.py).

    python -I /run/courier/init.py '<json config>' <command> [args...]

bubblewrap has made the namespaces and the filesystem; this script, the
sandbox's first process after bwrap's own init, finishes the job and then
becomes the agent:

* **Egress** (config ``proxy_port``): a forwarder process listens on
  ``127.0.0.1:<port>`` inside the sandbox's empty network namespace and
  relays each connection to courier's egress proxy through the unix socket
  bound at ``/run/courier/proxy.sock`` (the proxy's allowlist and
  private-range refusal decide where it goes). It listens before the agent
  starts, so the agent's first request never races it.
* **Identity**: when bwrap ran as root (no user namespace), every process
  here drops to the turn's own unprivileged uid and gid (``uid``/``gid``),
  with no supplementary groups; the kernel clears every capability with
  that. ``PR_SET_NO_NEW_PRIVS`` keeps a setuid binary from getting them back.
* **Limits** (``limits``: ``nproc``, ``nofile``, ``as``, ``fsize``):
  rlimits of the agent, inherited by everything it starts.

Standard library only, run in isolated mode: nothing from courier is imported.
"""

import ctypes
import json
import os
import resource
import socket
import sys
import threading

PROXY_SOCK = "/run/courier/proxy.sock"
CANNOT_START = 127
PR_SET_NO_NEW_PRIVS = 38
_RLIMITS = {"nproc": resource.RLIMIT_NPROC, "nofile": resource.RLIMIT_NOFILE, "as": resource.RLIMIT_AS,
            "fsize": resource.RLIMIT_FSIZE}


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _relay(client: socket.socket) -> None:
    up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        up.connect(PROXY_SOCK)
    except OSError:
        client.close()
        up.close()
        return
    t = threading.Thread(target=_pipe, args=(up, client), daemon=True)
    t.start()
    _pipe(client, up)
    t.join()
    client.close()
    up.close()


def _forward(listener: socket.socket) -> None:
    while True:
        try:
            client, _ = listener.accept()
        except OSError:
            return
        threading.Thread(target=_relay, args=(client,), daemon=True).start()


def _drop(uid: int | None, gid: int | None) -> None:
    if uid is None or gid is None:
        return
    os.setgroups([])
    os.setresgid(gid, gid, gid)
    os.setresuid(uid, uid, uid)


def main(argv: list[str]) -> int:
    if len(argv) < 3:
        print("usage: init.py <json config> <command> [args...]", file=sys.stderr)
        return 2
    cfg = json.loads(argv[1])
    uid, gid = cfg.get("uid"), cfg.get("gid")
    port = cfg.get("proxy_port")
    if port:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen(64)
        if os.fork() == 0:  # the forwarder: same identity as the agent, gone with the sandbox
            try:
                _drop(uid, gid)
                _forward(listener)
            finally:
                os._exit(0)
        listener.close()
    _drop(uid, gid)
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    for name, value in (cfg.get("limits") or {}).items():
        if value:
            _soft, hard = resource.getrlimit(_RLIMITS[name])
            v = int(value) if hard == resource.RLIM_INFINITY else min(int(value), hard)
            resource.setrlimit(_RLIMITS[name], (v, v))
    command = argv[2:]
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"courier: agent could not start: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
        return CANNOT_START
    return CANNOT_START  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))
