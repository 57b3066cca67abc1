# /etc/profile.d/pytorch-cuda.sh: a login shell (ssh, bash -l) gets docker run's environment
# back after /etc/profile has reset PATH. sshd mode writes the container's variables at start.
f=/var/lib/pytorch-cuda/sshd/environment.sh
if [ -r "$f" ]; then
    . "$f"
fi
unset f
if [ -n "${VIRTUAL_ENV:-}" ]; then
    case ":$PATH:" in
        *":$VIRTUAL_ENV/bin:"*) ;;
        *) PATH="$VIRTUAL_ENV/bin:$PATH"; export PATH ;;
    esac
fi
