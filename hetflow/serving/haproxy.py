"""Debian's HAProxy as the balancer's child process: master-worker mode, in a process group of its own,
dying with the thread that started it; its runtime API (the admin socket) and the master's CLI.

Its files (configuration, log, sockets) are in one run folder, each its owner's only (0600)."""

import atexit
import csv
import ctypes
import io
import os
import signal
import socket
import subprocess
import time

HAPROXY = "/usr/sbin/haproxy"
_PR_SET_PDEATHSIG = 1
_LIBC = ctypes.CDLL(None, use_errno=True)  # loaded before any fork: the child only calls it


class BalancerError(RuntimeError):
    """HAProxy refused a command or did not start; the message is HAProxy's own line."""


def _die_with_parent(parent_pid):
    """preexec: HAProxy's master gets SIGTERM when the thread that started it dies, even by SIGKILL;
    its workers leave when the master does (master-worker mode watches the master)."""
    _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os._exit(1)


def open_private(path, mode="w"):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.fchmod(fd, 0o600)  # a file left by an earlier run keeps its mode otherwise
    return os.fdopen(fd, mode)


def write_private(path, text):
    with open_private(path) as out:
        out.write(text)


class HAProxy:
    """One HAProxy in ``run_dir``: start(config_text), command(...), stop()."""

    def __init__(self, run_dir):
        self.run_dir = run_dir
        self.admin_socket = run_dir / "admin.sock"
        self.master_socket = run_dir / "master.sock"
        self.config_path = run_dir / "haproxy.cfg"
        self.log_path = run_dir / "haproxy.log"
        self._proc = None

    def start(self, config_text, timeout_s):
        """Write the configuration, start HAProxy, return once its master and worker answer; on any
        failure it is stopped again. The folder must exist."""
        write_private(self.config_path, config_text)
        log = open_private(self.log_path, "wb")
        try:
            self._proc = subprocess.Popen(
                [HAPROXY, "-W", "-f", str(self.config_path), "-S", f"{self.master_socket},mode,600"],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                start_new_session=True,
                preexec_fn=lambda parent=os.getpid(): _die_with_parent(parent),
            )
        finally:
            log.close()
        atexit.register(self.stop)
        try:
            self._wait_ready(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise BalancerError(f"haproxy exited ({self._proc.returncode}): {self._haproxy_error()}")
            try:
                # the master serves its CLI from its event loop, its signal handlers set: from then on
                # stop()'s SIGUSR1 is heard (sent earlier, it was lost)
                if "Pid:" in self.command("show info") and "worker" in self.command("show proc", master=True):
                    return
            except OSError:
                pass
            time.sleep(0.05)
        raise BalancerError(f"haproxy's admin socket did not answer within {timeout_s} s: {self._haproxy_error()}")

    def _haproxy_error(self):
        """HAProxy's first alert (the cause; later ones say it is exiting), else its last line."""
        lines = [line for line in self.log_path.read_text(errors="replace").splitlines() if line.strip()]
        alerts = [line for line in lines if "[ALERT]" in line]
        return (alerts or lines or ["no output"])[0 if alerts else -1]

    def stop(self, grace_s=5.0):
        """Soft stop (requests in flight finish, up to grace_s), then the whole process group is killed,
        even when a Ctrl-C interrupts the wait. Raises no error: it runs on the way out of failures too."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        try:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGUSR1)
                proc.wait(grace_s)
        except (OSError, subprocess.TimeoutExpired):
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # a worker still finishing, or the master itself
            except OSError:
                pass
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                pass
            atexit.unregister(self.stop)

    @property
    def pid(self):
        return self._proc.pid if self._proc else None

    @property
    def running(self):
        """HAProxy's master is alive (it exits if its worker dies: the owner should then stop and start)."""
        return self._proc is not None and self._proc.poll() is None

    def command(self, line, payload=None, master=False):
        """One runtime API command (several joined by ';'), its answer as text; master: to the master's CLI."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect(str(self.master_socket if master else self.admin_socket))
            if master:
                line += ";quit"  # the master's CLI keeps a connection open until told
            data = line + ("  <<\n" + payload + "\n\n" if payload is not None else "\n")
            conn.sendall(data.encode())
            chunks = []
            while chunk := conn.recv(65536):
                chunks.append(chunk)
        return b"".join(chunks).decode(errors="replace")

    def server_rows(self, pairs=None):
        """``show stat``'s rows of servers (not frontends or backends) as dicts of its CSV columns;
        pairs: only these (backend, server)."""
        text = self.command("show stat").lstrip("# ")
        rows = csv.DictReader(io.StringIO(text))
        wanted = set(pairs) if pairs is not None else None
        return [
            row
            for row in rows
            if row["svname"] not in ("FRONTEND", "BACKEND")
            and (wanted is None or (row["pxname"], row["svname"]) in wanted)
        ]
