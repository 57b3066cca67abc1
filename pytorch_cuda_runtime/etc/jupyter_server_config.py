# JupyterLab in this image: installed as /opt/venv/etc/jupyter/jupyter_server_config.py.
# Authentication is Jupyter's token, always: JUPYTER_TOKEN when set, else one generated at
# start and printed in the log. The entrypoint refuses an empty one (pytorch_cuda_runtime.services).
c = get_config()  # noqa: F821 - Jupyter's config loader provides it
c.ServerApp.ip = "0.0.0.0"          # reachable through `docker run -p 127.0.0.1:8888:8888`
c.ServerApp.port = 8888
c.ServerApp.port_retries = 0        # a taken port is an error, never a silent move to another one
c.ServerApp.root_dir = "/workspace"
c.ServerApp.open_browser = False
