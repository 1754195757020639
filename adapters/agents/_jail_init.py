"""The first program inside an agent's namespace sandbox (adapters/agents/jail.py).

    python -I -S /run/courier/init.py <uid> <gid> <nproc> <nofile> <as> <fsize> <proxy port> <command> [args...]

bubblewrap has made the namespaces and the filesystem; this finishes the job and
becomes the agent (``-`` for a value: none). With a `proxy port` a forwarder
listens on ``127.0.0.1:<port>`` in the sandbox's empty network and relays each
connection over ``/run/courier/proxy.sock`` to courier's egress proxy (which
decides); it listens before the agent starts, so no first request races it.
Then every process drops to `uid`/`gid` with no groups (the kernel clears the
capabilities; bwrap's ``PR_SET_NO_NEW_PRIVS`` keeps a setuid binary from getting
them back), and the rlimits are set for the agent and all it starts.
Standard library only, importing only what it uses: its start-up is part of
every sandboxed command's.
"""

import os
import resource
import sys

PROXY_SOCK = "/run/courier/proxy.sock"
CANNOT_START = 127
_RLIMITS = (resource.RLIMIT_NPROC, resource.RLIMIT_NOFILE, resource.RLIMIT_AS, resource.RLIMIT_FSIZE)


def _pipe(src, dst) -> None:
    import socket

    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _relay(client) -> None:
    import socket
    import threading

    with client, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as up:
        try:
            up.connect(PROXY_SOCK)
        except OSError:
            return
        t = threading.Thread(target=_pipe, args=(up, client), daemon=True)
        t.start()
        _pipe(client, up)
        t.join()


def _forward(listener) -> None:
    import threading

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


def _num(v: str) -> int | None:
    return None if v == "-" else int(v)


def main(argv: list[str]) -> int:
    if len(argv) < 9:
        print("usage: init.py <uid> <gid> <nproc> <nofile> <as> <fsize> <proxy port> <command> [args...]",
              file=sys.stderr)
        return 2
    uid, gid, nproc, nofile, as_bytes, fsize, port = (_num(v) for v in argv[1:8])
    if port:
        import socket

        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(64)
        if os.fork() == 0:  # the forwarder: same identity as the agent, gone with the sandbox
            try:
                _drop(uid, gid)
                _forward(listener)
            finally:
                os._exit(0)
        listener.close()
    _drop(uid, gid)
    for which, value in zip(_RLIMITS, (nproc, nofile, as_bytes, fsize)):
        if value:
            _soft, hard = resource.getrlimit(which)
            v = value if hard == resource.RLIM_INFINITY else min(value, hard)
            resource.setrlimit(which, (v, v))
    command = argv[8:]
    try:
        os.execvp(command[0], command)
    except OSError as exc:
        print(f"courier: agent could not start: {command[0]}: {exc.strerror or exc}", file=sys.stderr)
    return CANNOT_START


if __name__ == "__main__":
    sys.exit(main(sys.argv))
