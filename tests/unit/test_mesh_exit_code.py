"""The trainer mesh's exit code (launcher.mesh_exit_code): rank 0's own when it left one, so a
refused config is not retried; a peer killed by a signal reads as a plain failure, not 256-N."""

from moerl.components.policy_update.launcher import mesh_exit_code


def test_rank_0s_own_code_wins_over_the_first_failed_ranks(tmp_path):
    code_file = tmp_path / "result.json.code"
    code_file.write_text("2\n")
    assert mesh_exit_code(-9, code_file, "mesh") == 2
    code_file.write_text("")
    assert mesh_exit_code(3, code_file, "mesh") == 1


def test_a_rank_killed_by_a_signal_before_rank_0_saw_it_exits_1(tmp_path, caplog):
    assert mesh_exit_code(-9, tmp_path / "none", "the trainer mesh") == 1
    assert "killed by signal 9" in caplog.text


def test_any_other_code_is_the_failed_ranks(tmp_path):
    assert mesh_exit_code(2, tmp_path / "none", "mesh") == 2
