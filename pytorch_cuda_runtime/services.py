"""The entrypoint's server modes: `sshd` and `jupyter lab|notebook|server`.

Both run as the image's non-root user and never without authentication. Every input is
checked before anything starts: a bad one is one line on stderr and a non-zero exit
(2: bad input, 1: the container's environment is wrong), never a half-open server.

    docker run -d -e SSH_PUBLIC_KEY="$(cat ~/.ssh/id_ed25519.pub)" -p 127.0.0.1:2222:2222 IMAGE sshd
    docker run -d -p 127.0.0.1:8888:8888 IMAGE jupyter lab
"""
import errno
import os
import re
import shlex
import socket
import subprocess
import sys
import tempfile

from .errors import PytorchCudaError

SSHD = "/usr/sbin/sshd"
# sshd's StrictModes refuses a key file below any directory that group or others may write,
# the home directory included. /tmp is world-writable and /home/trainer group-writable (group 0
# may write it, for an arbitrary uid), so the image makes this directory: root's parents, owned
# by the image's user, mode 0700 (runtime.j2).
SSHD_DIR = "/var/lib/pytorch-cuda/sshd"
SSH_PORT, JUPYTER_PORT = 2222, 8888
# The variables of `docker run` that describe this container's session, not the image:
# a login gets its own, and the key and token must not be handed on to every login.
NOT_FORWARDED = {"HOME", "HOSTNAME", "PWD", "OLDPWD", "SHLVL", "TERM", "USER", "LOGNAME", "SHELL", "MAIL",
                 "_", "SSH_PUBLIC_KEY", "JUPYTER_TOKEN"}
JUPYTER_SERVERS = ("lab", "notebook", "server")
# Command-line ways to set Jupyter's token (jupyter_server 2: IdentityProvider; older: ServerApp/NotebookApp).
TOKEN_OPTION = re.compile(r"^--(?:IdentityProvider|ServerApp|NotebookApp)\.token(?:=(.*))?$")


class ServiceError(PytorchCudaError):
    """One line for the user; code 2 for bad input, 1 for the container's environment."""

    def __init__(self, message, code=2):
        super().__init__(message)
        self.code = code


# ---- sshd ------------------------------------------------------------------------------

def public_key(text):
    """The one OpenSSH public key in SSH_PUBLIC_KEY, validated by ssh-keygen; else ServiceError."""
    if text is None:
        raise ServiceError('sshd: SSH_PUBLIC_KEY is not set; pass your public key: -e SSH_PUBLIC_KEY="$(cat ~/.ssh/id_ed25519.pub)"')
    key = text.strip()
    if not key:
        raise ServiceError("sshd: SSH_PUBLIC_KEY is empty; pass the contents of your public key file (~/.ssh/id_*.pub)")
    if "PRIVATE KEY" in key:
        raise ServiceError("sshd: SSH_PUBLIC_KEY holds a private key; pass the public key (~/.ssh/id_*.pub) and keep the private one")
    if "\n" in key or "\r" in key:
        raise ServiceError("sshd: SSH_PUBLIC_KEY has several lines; pass exactly one public key (one line of ~/.ssh/id_*.pub)")
    with tempfile.NamedTemporaryFile("w", suffix=".pub") as f:
        f.write(key + "\n")
        f.flush()
        check = subprocess.run(["ssh-keygen", "-l", "-f", f.name], capture_output=True, text=True)
    if check.returncode != 0:
        raise ServiceError(f"sshd: SSH_PUBLIC_KEY is not an OpenSSH public key (it starts {key[:24]!r}); "
                           "pass one line like 'ssh-ed25519 AAAA... user@host'")
    return key


def port_number(text, name, default):
    if text is None or text == "":
        return default
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise ServiceError(f"{name} must be a port number from 1 to 65535, not {text!r}")
    return int(text)


def port_free(host, port, what):
    """Fail before starting if the port is taken: sshd and Jupyter would say it only in their log."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise ServiceError(f"{what}: port {port} on {host} is already in use; choose another one", 1) from e
            raise ServiceError(f"{what}: cannot listen on {host}:{port}: {e.strerror}", 1) from e


def login_environment(environ):
    """The container's environment a login must see too (PATH with the venv, VIRTUAL_ENV, NCCL_*, ...)."""
    return {k: v for k, v in sorted(environ.items())
            if k not in NOT_FORWARDED and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) and "\n" not in v and '"' not in v}


def sshd_config(d, port, listen, user, env):
    setenv = " ".join(f'"{k}={v}"' for k, v in env.items())
    lines = [
        "# Written by pytorch-cuda-entrypoint at container start; host keys are this container's own.",
        f"Port {port}",
        f"ListenAddress {listen}",
        f"HostKey {d}/ssh_host_ed25519_key",
        f"HostKey {d}/ssh_host_ecdsa_key",
        f"PidFile {d}/sshd.pid",
        f"AuthorizedKeysFile {d}/authorized_keys",
        # Key only. A non-root sshd can authenticate no one but its own user in any case.
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "PermitEmptyPasswords no",
        "PermitRootLogin no",
        f"AllowUsers {user}",
        "UsePAM no",
        "StrictModes yes",
        "PermitUserEnvironment no",
        "X11Forwarding no",
        "PrintMotd no",
        "Subsystem sftp internal-sftp",
    ]
    if setenv:
        lines.append(f"SetEnv {setenv}")  # `ssh node cmd` (pdsh) gets docker run's PATH and venv
    return "\n".join(lines) + "\n"


def profile_script(env):
    """Sourced by login shells (/etc/profile.d/pytorch-cuda.sh), after /etc/profile has reset PATH."""
    return "".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items())


def prepare_sshd(environ, d, user, uid):
    """Check everything, write this container's sshd directory d; return sshd's argv."""
    if uid == 0:
        raise ServiceError("sshd: runs as the image's non-root user; drop --user root (root logins are refused anyway)")
    key = public_key(environ.get("SSH_PUBLIC_KEY"))
    port = port_number(environ.get("SSH_PORT"), "SSH_PORT", SSH_PORT)
    listen = environ.get("SSH_LISTEN", "0.0.0.0")
    port_free(listen, port, "sshd")
    try:
        os.chmod(d, 0o700)  # sshd would refuse its keys in a directory others may write
    except OSError as e:
        raise ServiceError(f"sshd: cannot use {d}, which the image gives its user (uid 1000): {e.strerror}", 1) from e
    for kind in ("ed25519", "ecdsa"):
        path = os.path.join(d, f"ssh_host_{kind}_key")
        for old in (path, path + ".pub"):
            if os.path.exists(old):
                os.unlink(old)  # a restarted container keeps its layer: still its own keys, but new ones
        subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-C", f"{socket.gethostname()}-{kind}", "-f", path],
                       check=True, stdout=subprocess.DEVNULL)
    env = login_environment(environ)
    _write(os.path.join(d, "authorized_keys"), key + "\n")
    _write(os.path.join(d, "environment.sh"), profile_script(env))
    _write(os.path.join(d, "sshd_config"), sshd_config(d, port, listen, user, env))
    check = subprocess.run([SSHD, "-t", "-f", os.path.join(d, "sshd_config")], capture_output=True, text=True)
    if check.returncode != 0:
        raise ServiceError(f"sshd: its configuration was refused: {check.stderr.strip().splitlines()[-1]}", 1)
    print(f"sshd: key-only login as {user} on {listen}:{port} for key {key.split()[0]} "
          f"...{key.split()[1][-12:]}", file=sys.stderr, flush=True)
    return [SSHD, "-D", "-e", "-f", os.path.join(d, "sshd_config")]


def account(uid):
    """The login name of uid: sshd authenticates only users /etc/passwd knows, and an arbitrary
    uid (OpenShift's, Apptainer's or enroot's caller's) has no entry there."""
    import pwd
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        raise ServiceError(f"sshd: uid {uid} has no account in /etc/passwd, and sshd logs in only users it knows; "
                           "run sshd mode as the image's user (uid 1000, the default), or start training with "
                           "pytorch-cuda-launch, which needs no ssh", 1) from None


def _write(path, text):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


# ---- jupyter ---------------------------------------------------------------------------

def jupyter_checks(args, environ, root_dir="/workspace"):
    """Refuse to start a Jupyter server without a token, with nowhere to save, or on a taken port."""
    token = environ.get("JUPYTER_TOKEN")
    if token is not None and not token.strip():
        raise ServiceError("jupyter: JUPYTER_TOKEN is empty, which would turn authentication off; "
                           "set a token or leave JUPYTER_TOKEN unset for a generated one")
    for a in args:
        m = TOKEN_OPTION.match(a)
        if m and not (m.group(1) or "").strip():
            raise ServiceError(f"jupyter: {a.split('=')[0]} with an empty value would turn authentication off; "
                               "give a token or leave it out for a generated one")
    root = _option(args, ("--ServerApp.root_dir", "--notebook-dir", "--ServerApp.notebook_dir")) or root_dir
    if not _writable(root):
        raise ServiceError(f"jupyter: {root} is not writable by uid {os.getuid()}; notebooks could not be saved "
                           "(mount a directory this user owns, e.g. -v \"$PWD:/workspace\" with --user \"$(id -u):$(id -g)\")", 1)
    port = port_number(_option(args, ("--port", "--ServerApp.port")), "--port", JUPYTER_PORT)
    ip = _option(args, ("--ip", "--ServerApp.ip")) or "0.0.0.0"
    port_free(ip, port, "jupyter")


def _option(args, names):
    for i, a in enumerate(args):
        for n in names:
            if a.startswith(n + "="):
                return a.split("=", 1)[1]
            if a == n and i + 1 < len(args):
                return args[i + 1]
    return None


def _writable(path):
    try:
        with tempfile.TemporaryFile(dir=path):
            return True
    except OSError:
        return False


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv[:1] == ["sshd"]:
            user = account(os.getuid())
            cmd = prepare_sshd(os.environ, SSHD_DIR, user, os.getuid())
        elif argv[:1] == ["jupyter"] and argv[1:2] and argv[1] in JUPYTER_SERVERS:
            jupyter_checks(argv[2:], os.environ)
            cmd = argv
        else:
            cmd = argv
    except ServiceError as e:
        print(f"pytorch-cuda: error: {e}", file=sys.stderr)
        return e.code
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)


if __name__ == "__main__":
    sys.exit(main())
