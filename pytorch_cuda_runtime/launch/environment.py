"""The environment torchrun and the ranks get: the image's, whatever started the container.

`srun --container` (Slurm 22.05) merges the job's environment into the image's, so srun's PATH
and HOME replace the image's; Apptainer and enroot run the image as the calling user; OpenShift
as an arbitrary uid in group 0 (HOME=/ and no passwd entry). So:

  PATH   the image's (PYTORCH_CUDA_PATH, which the image sets to its own PATH at build time;
         else /opt/venv/bin), then the entries of the current PATH it lacks
  HOME   $HOME where it is a writable directory, else this uid's passwd home, else the image
         user's (/home/trainer), else $TMPDIR (or /tmp)/pytorch-cuda-home-<uid>, made 0700
  caches each one that is unset or not writable: XDG_CACHE_HOME=$HOME/.cache,
         HF_HOME=$XDG_CACHE_HOME/huggingface, TRITON_CACHE_DIR=$XDG_CACHE_HOME/triton,
         TORCHINDUCTOR_CACHE_DIR=$TMPDIR/torchinductor_<uid> (Inductor's own default names the
         user, and getpass fails for a uid with no passwd entry),
         FLASH_ATTENTION_CUTE_DSL_CACHE_DIR=$XDG_CACHE_HOME/flash_attention_cute_dsl (FlashAttention 4's
         compiled kernels, where the train image enables its disk cache; its default also names the user)
  unset  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
         PET_*: torchrun reads PET_* as its own options, and sets the rest for each rank.
TORCH_EXTENSIONS_DIR is left alone: with it unset, torch finds the image's prebuilt CPU ops
under /home/trainer/.cache (PYTORCH_CUDA_CPU_OPS), which group 0 may write (runtime.j2).

The entrypoint applies the HOME and cache rules too, with nothing else changed:
`python -m pytorch_cuda_runtime.launch.environment` prints them as sh `export` lines.
"""
from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Callable, Mapping

VENV_BIN = "/opt/venv/bin"  # Dockerfile.base: python3 -m venv /opt/venv
IMAGE_HOME = "/home/trainer"  # Dockerfile.base: useradd --uid 1000 trainer
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
CLEARED = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
           "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def writable(path: str) -> bool:
    """A directory that exists and takes files, or could be made where its nearest parent does."""
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            return False
        path = parent
    return os.path.isdir(path) and os.access(path, os.W_OK | os.X_OK)


def image_path(env: Mapping[str, str]) -> str:
    current = env.get("PATH") or SYSTEM_PATH
    image = env.get("PYTORCH_CUDA_PATH") or VENV_BIN
    entries: list[str] = []
    for entry in image.split(":") + current.split(":"):
        if entry and entry not in entries:
            entries.append(entry)
    return ":".join(entries)


def tmp_dir(env: Mapping[str, str], is_writable: Callable[[str], bool]) -> str:
    tmp = env.get("TMPDIR", "")
    return tmp if tmp.startswith("/") and is_writable(tmp) else "/tmp"


def choose_home(env: Mapping[str, str], uid: int, passwd_home: str | None,
                is_writable: Callable[[str], bool]) -> tuple[str, str]:
    """A writable HOME and why it was chosen."""
    home = env.get("HOME", "")
    if home.startswith("/") and home != "/" and is_writable(home):
        return home, "HOME"
    for candidate, why in ((passwd_home, f"uid {uid}'s home"), (IMAGE_HOME, "the image user's home")):
        if candidate and candidate != "/" and is_writable(candidate):
            return candidate, why
    return f"{tmp_dir(env, is_writable)}/pytorch-cuda-home-{uid}", "no writable home"


def home_and_caches(env: Mapping[str, str], uid: int, passwd_home: str | None,
                    is_writable: Callable[[str], bool] = writable) -> tuple[dict[str, str], list[str]]:
    """The variables to set so HOME and every cache are writable, and one line per change."""
    out: dict[str, str] = {}
    changes: list[str] = []

    def put(name: str, value: str, why: str) -> None:
        if env.get(name) != value:
            out[name] = value
            changes.append(f"{name}={value} ({why})")

    home, why = choose_home(env, uid, passwd_home, is_writable)
    put("HOME", home, why if env.get("HOME") in (None, "") else f"{why}: HOME={env['HOME']} is not a writable directory")
    cache = env.get("XDG_CACHE_HOME", "")
    if not (cache.startswith("/") and is_writable(cache)):
        cache = f"{home}/.cache"
        put("XDG_CACHE_HOME", cache, "unset or not writable")
    for name, default in (("HF_HOME", f"{cache}/huggingface"), ("TRITON_CACHE_DIR", f"{cache}/triton"),
                          ("FLASH_ATTENTION_CUTE_DSL_CACHE_DIR", f"{cache}/flash_attention_cute_dsl"),
                          ("TORCHINDUCTOR_CACHE_DIR", f"{tmp_dir(env, is_writable)}/torchinductor_{uid}")):
        value = env.get(name, "")
        if not (value.startswith("/") and is_writable(value)):
            put(name, default, "unset or not writable")
    return out, changes


def child_env(env: Mapping[str, str], uid: int, passwd_home: str | None,
              is_writable: Callable[[str], bool] = writable) -> tuple[dict[str, str], list[str]]:
    """torchrun's environment, and one line per change for --print."""
    out = {k: v for k, v in env.items() if k not in CLEARED and not k.startswith("PET_")}
    removed = sorted(k for k in env if k not in out)
    changes = [f"unset {' '.join(removed)} (torchrun sets the ranks' own)"] if removed else []
    path = image_path(env)
    if env.get("PATH") != path:
        out["PATH"] = path
        changes.append(f"PATH={path} (the image's PATH first)")
    more, lines = home_and_caches(env, uid, passwd_home, is_writable)
    out.update(more)
    return out, changes + lines


def passwd_home(uid: int) -> str | None:
    try:
        import pwd
        return pwd.getpwuid(uid).pw_dir
    except (ImportError, KeyError):
        return None


def main(env: Mapping[str, str] | None = None) -> int:
    """The entrypoint's step: sh `export` lines on stdout, HOME made (0700) where it is new, and
    one line on stderr when HOME moves. Never fails: a container must start even so."""
    env = os.environ if env is None else env
    uid = os.getuid()
    changed, lines = home_and_caches(env, uid, passwd_home(uid))
    home = changed.get("HOME")
    if home:
        try:
            os.makedirs(home, mode=0o700, exist_ok=True)
        except OSError as e:
            print(f"pytorch-cuda: warning: cannot make HOME {home}: {e.strerror}", file=sys.stderr)
        if env.get("PYTORCH_CUDA_NO_BANNER", "0") != "1":
            print(f"pytorch-cuda: uid {uid}: {lines[0]}", file=sys.stderr)
    print("".join(f"export {k}={shlex.quote(v)}\n" for k, v in changed.items()), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
