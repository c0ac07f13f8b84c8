"""gpucourse.tools.labconfig: the server setting that keeps JupyterLab's status bar busy while a launch cell runs
(the browser check is tests/integration/test_browser.py::test_status_stays_busy_while_a_launch_runs)."""
import json

import pytest
from jupyter_server.services.kernels.kernelmanager import MappingKernelManager

from gpucourse import labconfig


def test_adds_the_subshell_requests_and_keeps_every_default():
    default = MappingKernelManager.class_traits()["untracked_message_types"].default()
    listed = labconfig.untracked_message_types()
    assert listed[:len(default)] == default and "debug_request" in listed
    assert {"create_subshell_request", "delete_subshell_request"} <= set(listed)
    assert len(listed) == len(set(listed))


def test_write_keeps_the_rest_of_the_file(tmp_path):
    (tmp_path / "jupyter_server_config.json").write_text(json.dumps(
        {"ServerApp": {"open_browser": False}, "MappingKernelManager": {"cull_idle_timeout": 600}}))
    path = labconfig.write(tmp_path)
    config = json.loads(path.read_text())
    assert config["ServerApp"] == {"open_browser": False}
    assert config["MappingKernelManager"]["cull_idle_timeout"] == 600
    assert config["MappingKernelManager"]["untracked_message_types"] == labconfig.untracked_message_types()
    assert labconfig.write(tmp_path).read_text() == path.read_text()  # running it again changes nothing


def test_bad_json_is_named(tmp_path):
    (tmp_path / "jupyter_server_config.json").write_text("{not json")
    with pytest.raises(SystemExit, match="jupyter_server_config.json is not valid JSON"):
        labconfig.write(tmp_path)


def test_main_writes_under_the_prefix(tmp_path, capsys):
    assert labconfig.main([str(tmp_path)]) == 0
    assert (tmp_path / "etc" / "jupyter" / "jupyter_server_config.json").exists()
    assert labconfig.main([]) == 2 and "usage" in capsys.readouterr().err
