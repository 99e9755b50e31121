"""tools/suite_seconds.py: per-file sums of pytest's --durations report, against sums
worked out by hand."""

from tools import suite_seconds

REPORT = """\
============================= slowest durations =============================
12.50s call     tests/a_test.py::test_one[x-1]
2.25s setup    tests/a_test.py::test_one[x-1]
0.25s teardown tests/a_test.py::test_one[x-1]
3.00s call     tests/b_test.py::test_two
1.00s call     tests/a_test.py::test_three
=========================== short test summary info ============================
1 failed, 4 passed, 2 skipped in 20.00s (0:00:20)
"""


def test_phases_add_up_per_file_and_tests_count_once():
  seconds, tests, wall = suite_seconds.seconds_by_file(REPORT.splitlines())
  assert seconds == {"tests/a_test.py": 16.0, "tests/b_test.py": 3.0}
  assert tests == {"tests/a_test.py": 2, "tests/b_test.py": 1}
  assert wall == 20.0
