"""A real, throw-away SLURM cluster on this single host, for tests and CI.

Self-contained (no project imports). Everything lives under one work directory:

    munge/      munged with its own key and socket
    mysql/      mariadbd on a private unix socket (no TCP), datadir in workdir
    etc/        slurm.conf + slurmdbd.conf (cgroup-free: proctrack/linuxproc, task/none)
    log/ run/ spool/ state/

Daemons: munged, mariadbd, slurmdbd, slurmctld and one slurmd per node (``node1`` on 127.0.0.11,
``node2`` on 127.0.0.12, each declaring ``cpus_per_node`` CPUs via ``SlurmdParameters=config_overrides``).
Each slurmd runs in its own UTS namespace whose hostname is the node name (when ``unshare`` works), so
``hostname``/``socket.gethostname()`` inside a job step tell the nodes apart like on a real cluster.
All daemons run in the foreground as our children and are stopped by PID.

Needs root (slurmd launches job steps; node names are added to /etc/hosts) and the Debian packages
installed by ``.ci/install_slurm.sh``. Clients (sbatch, srun, sacct, submitit) need ``env()``
(``SLURM_CONF``) in their environment.
"""

from __future__ import annotations

import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

NODES = (("node1", "127.0.0.11"), ("node2", "127.0.0.12"))
TERMINAL_STATES = {
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "OUT_OF_MEMORY",
    "BOOT_FAIL",
    "DEADLINE",
}
_BINARIES = (
    "munged",
    "munge",
    "mariadbd",
    "mariadb-install-db",
    "mariadb",
    "slurmdbd",
    "slurmctld",
    "slurmd",
    "sbatch",
    "srun",
    "squeue",
    "sacct",
    "scontrol",
    "sinfo",
    "sacctmgr",
    "scancel",
)
_SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")


def _which(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=os.pathsep.join(_SBIN))


def slurm_available() -> tuple[bool, str]:
    """(True, "") if a test cluster can be started here, else (False, reason)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return False, "the test SLURM cluster needs root (slurmd, /etc/hosts)"
    missing = [b for b in _BINARIES if _which(b) is None]
    if missing:
        return False, f"SLURM test cluster binaries missing: {' '.join(missing)} (run .ci/install_slurm.sh)"
    return True, ""


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM the daemon if the process that started it dies (e.g. a killed pytest)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _can_unshare_uts() -> bool:
    unshare = _which("unshare")
    return bool(unshare) and subprocess.run([unshare, "--uts", "true"], capture_output=True).returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = 30) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()[-n:]
    except OSError as e:
        return f"<no log {path}: {e.strerror}>"
    return f"--- last {len(lines)} lines of {path} ---\n" + "\n".join(lines)


class SlurmClusterError(RuntimeError):
    pass


class SlurmCluster:
    def __init__(
        self,
        workdir,
        cluster_name: str = "ddplab",
        nodes=NODES,
        cpus_per_node: int = 4,
        real_memory_mb: int = 16000,
        partition: str = "debug",
        uts_namespaces: bool = True,
    ):
        self.workdir = Path(workdir).resolve()
        self.cluster_name = cluster_name
        self.nodes = tuple(nodes)
        self.cpus_per_node = cpus_per_node
        self.real_memory_mb = real_memory_mb
        self.partition = partition
        self.uts_namespaces = uts_namespaces
        self.procs: dict[str, subprocess.Popen] = {}  # name -> daemon (started in this order)
        self.logs: dict[str, Path] = {}  # name -> log file shown on errors
        d = self.workdir
        self.conf = d / "etc" / "slurm.conf"
        self.munge_socket = d / "munge" / "munge.sock"
        self.mysql_socket = d / "mysql" / "mysql.sock"

    # ------------------------------------------------------------------ client side
    def env(self) -> dict[str, str]:
        """Environment variables a SLURM client (sbatch/srun/sacct, submitit) needs for this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def client_env(self) -> dict[str, str]:
        """os.environ without inherited SLURM_* job variables, plus env()."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        env.update(self.env())
        return env

    def run(self, *cmd: str, timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
        """Run a SLURM client command against this cluster; returns the CompletedProcess (text)."""
        kw.setdefault("cwd", self.workdir)
        p = subprocess.run(cmd, env=self.client_env(), capture_output=True, text=True, timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise SlurmClusterError(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}{p.stderr}")
        return p

    def sbatch(self, *args: str, cwd=None) -> str:
        """Submit with sbatch --parsable; returns the job id."""
        return self.run("sbatch", "--parsable", *args, cwd=cwd or self.workdir).stdout.strip().split(";")[0]

    def squeue(self, job_id: str | None = None) -> dict[str, str]:
        """{job id: state} of jobs slurmctld still lists."""
        args = ["squeue", "-h", "-o", "%i %T"] + (["-j", job_id] if job_id else [])
        out = self.run(*args, check=False).stdout
        return dict(line.split()[:2] for line in out.splitlines() if len(line.split()) >= 2)

    def sacct(self, job_id: str) -> dict[str, str]:
        """{job or step id: state} from accounting (slurmdbd), e.g. {"5": "COMPLETED", "5.batch": ...}."""
        out = self.run("sacct", "-j", job_id, "-n", "-P", "-o", "JobID,State").stdout
        states = {}
        for line in out.splitlines():
            jid, _, state = line.partition("|")
            states[jid] = state.split()[0] if state else ""  # "CANCELLED by 0" -> "CANCELLED"
        return states

    def wait_job(self, job_id: str, timeout: float = 60, states=TERMINAL_STATES) -> str:
        """Wait until sacct reports the job in one of `states`; returns that state."""
        deadline, last = time.monotonic() + timeout, None
        while time.monotonic() < deadline:
            last = self.sacct(job_id).get(job_id)
            if last in states:
                return last
            time.sleep(0.3)
        raise SlurmClusterError(
            f"job {job_id} not in {sorted(states)} after {timeout}s (sacct: {last}, "
            f"squeue: {self.squeue(job_id)})\n{self._log_tails('slurmctld')}"
        )

    # ------------------------------------------------------------------ lifecycle
    def start(self, timeout: float = 60) -> SlurmCluster:
        ok, reason = slurm_available()
        if not ok:
            raise SlurmClusterError(reason)
        deadline = time.monotonic() + timeout
        if self.uts_namespaces and not _can_unshare_uts():
            self.uts_namespaces = False  # e.g. docker without CAP_SYS_ADMIN: nodes keep this host's name
        try:
            self._prepare()
            self._start_munge(deadline)
            self._start_mariadb(deadline)
            self._spawn("slurmdbd", [_which("slurmdbd"), "-D"], self.workdir / "log" / "slurmdbd.log")
            self._wait("slurmdbd", deadline, lambda: self._port_open(self.dbd_port))
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-i"], self.workdir / "log" / "slurmctld.log")
            self._wait("slurmctld", deadline, lambda: "is UP" in self.run("scontrol", "ping", check=False).stdout)
            for name, _ in self.nodes:
                cmd = [_which("slurmd"), "-D", "-N", name]
                if self.uts_namespaces:
                    cmd = [_which("unshare"), "--uts", "sh", "-c", 'hostname "$0" && exec "$@"', name] + cmd
                self._spawn(f"slurmd.{name}", cmd, self.workdir / "log" / f"slurmd.{name}.log")
            self._wait("slurmd.*", deadline, self._nodes_idle)
            self._wait("slurmdbd", deadline, self._cluster_registered)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15) -> None:
        """Cancel jobs, stop every daemon by PID (reverse start order), kill leftover job processes,
        delete the database and munge key (logs and configs stay in workdir for debugging)."""
        if "slurmctld" in self.procs and self.procs["slurmctld"].poll() is None:
            try:
                jobs = self.squeue()
                if jobs:
                    self.run("scancel", *jobs, check=False, timeout=10)
                end = time.monotonic() + 10
                while self.squeue() and time.monotonic() < end:
                    time.sleep(0.2)
            except (subprocess.SubprocessError, OSError):
                pass
        for name in reversed(list(self.procs)):
            self._terminate(self.procs[name], timeout)
        self.procs.clear()
        self._kill_strays()
        for path in (self.workdir / "mysql" / "data", self.workdir / "munge" / "key"):
            shutil.rmtree(path, ignore_errors=True)

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items() if p.poll() is None}

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    # ------------------------------------------------------------------ internals
    def _prepare(self) -> None:
        d = self.workdir
        for sub in ("etc", "log", "run", "state", "mysql", "munge/key", "jobs"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        for name, _ in self.nodes:
            (d / "spool" / name).mkdir(parents=True, exist_ok=True)
        (d / "munge").chmod(0o755)  # munged insists the socket dir is world-executable
        self._add_hosts()
        self.ctld_port, self.dbd_port = _free_port(), _free_port()
        self.node_ports = {name: _free_port() for name, _ in self.nodes}
        host = socket.gethostname().split(".")[0]
        auth = f"AuthType=auth/munge\nAuthInfo=socket={self.munge_socket}\n"
        nodes = "\n".join(
            f"NodeName={n} NodeAddr={a} NodeHostname={n} Port={self.node_ports[n]} CPUs={self.cpus_per_node} "
            f"RealMemory={self.real_memory_mb} State=UNKNOWN"
            for n, a in self.nodes
        )
        self.conf.write_text(f"""\
ClusterName={self.cluster_name}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
{auth}CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/run/slurmctld.pid
SlurmdPidFile={d}/run/slurmd.%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd.%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SlurmdParameters=config_overrides
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={self.dbd_port}
AccountingStoragePass={self.munge_socket}
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=batch_sched_delay=0
FirstJobId={self.ctld_port * 100}
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
SlurmdTimeout=30
InactiveLimit=0
KillWait=5
MinJobAge=300
{nodes}
PartitionName={self.partition} Nodes={",".join(n for n, _ in self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        dbd = self.conf.with_name("slurmdbd.conf")
        dbd.write_text(f"""\
{auth}DbdHost={host}
DbdAddr=127.0.0.1
DbdPort={self.dbd_port}
SlurmUser=root
PidFile={d}/run/slurmdbd.pid
LogFile={d}/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
""")
        dbd.chmod(0o600)  # slurmdbd refuses a config readable by others

    def _add_hosts(self) -> None:
        """Node names must resolve to their NodeAddr (srun, DDP MASTER_ADDR). Idempotent; left in place."""
        hosts = Path("/etc/hosts")
        text = hosts.read_text()
        known = {tuple(line.split()[:2]) for line in text.splitlines() if line.strip() and not line.startswith("#")}
        new = [f"{a} {n}" for n, a in self.nodes if (a, n) not in known]
        if new:
            sep = "" if text.endswith("\n") else "\n"
            with hosts.open("a") as f:
                f.write(sep + "\n".join(f"{line}  # ddplab test SLURM cluster" for line in new) + "\n")

    def _start_munge(self, deadline: float) -> None:
        key = self.workdir / "munge" / "key" / "munge.key"
        if not key.exists():
            key.write_bytes(secrets.token_bytes(1024))
        key.chmod(0o400)
        (self.workdir / "munge" / "key").chmod(0o700)
        m = self.workdir / "munge"
        # --force: pytest's tmp dirs are 0700, which munged would otherwise reject for the socket path
        self._spawn(
            "munged",
            [
                _which("munged"),
                "-F",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={m}/munged.pid",
                f"--seed-file={m}/munged.seed",
                f"--log-file={m}/munged.log",
            ],
            m / "munged.log",
        )
        self._wait(
            "munged",
            deadline,
            lambda: (
                subprocess.run([_which("munge"), "-n", "-S", str(self.munge_socket)], capture_output=True).returncode
                == 0
            ),
        )

    def _start_mariadb(self, deadline: float) -> None:
        m = self.workdir / "mysql"
        common = ["--no-defaults", f"--datadir={m}/data", "--user=root", "--innodb-log-file-size=8M"]
        if not (m / "data" / "mysql").exists():
            p = subprocess.run(
                [_which("mariadb-install-db"), *common, "--auth-root-authentication-method=socket", "--skip-test-db"],
                capture_output=True,
                text=True,
                timeout=max(5, deadline - time.monotonic()),
            )
            if p.returncode:
                raise SlurmClusterError(f"mariadb-install-db failed:\n{p.stdout}{p.stderr}")
        self._spawn(
            "mariadbd",
            [
                _which("mariadbd"),
                *common,
                f"--socket={self.mysql_socket}",
                "--skip-networking",
                f"--pid-file={m}/mariadbd.pid",
                f"--log-error={m}/error.log",
                "--innodb-buffer-pool-size=64M",
                "--innodb-lock-wait-timeout=900",
            ],
            m / "error.log",
        )
        self._wait(
            "mariadbd",
            deadline,
            lambda: (
                subprocess.run(
                    [_which("mariadb"), "--no-defaults", "-S", str(self.mysql_socket), "-u", "root", "-e", "select 1"],
                    capture_output=True,
                ).returncode
                == 0
            ),
        )

    def _spawn(self, name: str, cmd: list, log: Path) -> None:
        env = self.client_env()
        env["MYSQL_UNIX_PORT"] = str(self.mysql_socket)  # slurmdbd's libmariadb: StorageHost=localhost -> socket
        out = open(self.workdir / "log" / f"{name}.stdout", "ab")
        try:
            self.procs[name] = subprocess.Popen(
                cmd,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=self.workdir,
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        finally:
            out.close()
        self.logs[name] = log

    def _wait(self, what: str, deadline: float, ready) -> None:
        names = [n for n in self.procs if n == what or (what.endswith("*") and n.startswith(what[:-1]))]
        while True:
            dead = [n for n in names if self.procs[n].poll() is not None]
            if dead:
                raise SlurmClusterError(
                    f"{dead[0]} exited with {self.procs[dead[0]].returncode} during start\n" + self._log_tails(dead[0])
                )
            try:
                if ready():
                    return
            except (subprocess.SubprocessError, OSError):
                pass
            if time.monotonic() > deadline:
                raise SlurmClusterError(f"timed out waiting for {what}\n" + self._log_tails(*names))
            time.sleep(0.1)

    def _log_tails(self, *names: str) -> str:
        parts = []
        for n in names or self.logs:
            parts.append(_tail(self.logs[n]) if n in self.logs else f"<no log for {n}>")
            so = self.workdir / "log" / f"{n}.stdout"
            if so.exists() and so.stat().st_size:
                parts.append(_tail(so, 10))
        return "\n".join(parts)

    @staticmethod
    def _port_open(port: int) -> bool:
        with socket.socket() as s:
            s.settimeout(0.5)
            return s.connect_ex(("127.0.0.1", port)) == 0

    def _nodes_idle(self) -> bool:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
        states = dict(zip(out[::2], out[1::2]))
        return all(states.get(n) == "idle" for n, _ in self.nodes)

    def _cluster_registered(self) -> bool:
        out = self.run("sacctmgr", "-n", "-P", "show", "cluster", "format=cluster", check=False).stdout
        return self.cluster_name in out.split()

    @staticmethod
    def _terminate(proc: subprocess.Popen, timeout: float) -> None:
        if proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def _kill_strays(self) -> None:
        """SIGKILL processes left by this cluster's jobs (slurmstepd, tasks): their environ names our SLURM_CONF."""
        marker = f"SLURM_CONF={self.conf}".encode()
        me = os.getpid()
        for pid_dir in Path("/proc").glob("[0-9]*"):
            pid = int(pid_dir.name)
            if pid == me:
                continue
            try:
                if marker in (pid_dir / "environ").read_bytes().split(b"\0"):
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
