"""``JupyterEnv``: a stateful Python kernel in the sandbox, plus a shell tool."""
