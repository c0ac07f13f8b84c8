"""Jupyter server settings the course's JupyterLab needs, written where that JupyterLab reads them.

Why: with ipykernel 7 and JupyterLab 4.4+, the status bar said "Idle" for the whole of a cell that launched a
job, while the cell still ran. JupyterLab opens a kernel *subshell* for a comm target the first time the kernel
opens a comm on it (the launch view's widgets: target "jupyter.widget"); it asks with a `create_subshell_request`
on the control channel. ipykernel answers control requests from its control thread even while a cell runs, and
publishes `status: busy`, then `status: idle`, on iopub with that request as parent. JupyterLab's kernel model
(@jupyterlab/services KernelConnection) takes every iopub status as the kernel's status, except those whose
parent's type is in the page option `untracked_message_types`, which jupyter_server fills from
`MappingKernelManager.untracked_message_types`. That list names debug_request, kernel_info_request,
comm_info_request and the other control requests, but not the subshell ones (jupyter_server 2.21.1): so the
subshell's "idle" becomes the kernel's status, and nothing sets it back to busy until the cell's own "idle".
The list's help says it "should be a superset of the message types sent on any channel other than the shell
channel": we add the subshell requests and replies, keeping every default.

    python -m gpucourse.tools.labconfig PREFIX    # sets it in PREFIX/etc/jupyter/jupyter_server_config.json

`make lab` runs it for .venv (sys.prefix/etc/jupyter is on the config path of that venv's Jupyter); the browser
tests write it into the config directory of the JupyterLab they start. (A jupyter_server_config.d/*.json file
would not do: the server reads those only for enabling extensions.)
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

# Control-channel requests (and replies) of the kernel subshells protocol (JEP 91), which ipykernel 7 implements.
SUBSHELL_MESSAGES = ["create_subshell_request", "create_subshell_reply", "delete_subshell_request",
                     "delete_subshell_reply", "list_subshell_request", "list_subshell_reply"]
FILE_NAME = "jupyter_server_config.json"


def untracked_message_types() -> list[str]:
    """jupyter_server's default list plus the subshell messages (a setting replaces the default list)."""
    from jupyter_server.services.kernels.kernelmanager import MappingKernelManager

    default = MappingKernelManager.class_traits()["untracked_message_types"].default()
    return list(default) + [t for t in SUBSHELL_MESSAGES if t not in default]


def write(config_dir) -> Path:
    """Set the list in the server config file of a Jupyter config directory (one of `jupyter --paths`' config
    list), keeping whatever else that file holds."""
    path = Path(config_dir) / FILE_NAME
    try:
        config = json.loads(path.read_text()) if path.exists() else {}
    except json.JSONDecodeError as err:
        raise SystemExit(f"{path} is not valid JSON ({err}): fix or remove it, then run this again") from None
    config.setdefault("MappingKernelManager", {})["untracked_message_types"] = untracked_message_types()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=1) + "\n")
    return path


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(f"usage: python -m gpucourse.tools.labconfig PREFIX   (e.g. .venv: sets PREFIX/etc/jupyter/{FILE_NAME})",
              file=sys.stderr)
        return 2
    print(f"wrote {write(Path(argv[0]) / 'etc' / 'jupyter')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
