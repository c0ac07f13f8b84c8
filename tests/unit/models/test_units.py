"""gpucourse.models.units: one formatter per quantity, the text the chapters, figures and widgets show."""
import pytest

from gpucourse.models.units import human_bytes, human_percent, human_seconds, human_si


def test_bytes_binary_for_buffers_and_decimal_for_model_memory():
    assert [human_bytes(n) for n in (8, 1536, 2**24, 3 * 2**30)] == ["8 B", "1.5 KiB", "16 MiB", "3 GiB"]
    assert [human_bytes(n, decimal=True) for n in (12, 1.2e3, 512e6, 1.875e9, 31.40625e9, 2e12)] == [
        "12 B", "1.2 kB", "512 MB", "1.88 GB", "31.4 GB", "2 TB"]


@pytest.mark.parametrize("seconds, text", [(2.5e-6, "2.5 µs"), (5e-4, "500 µs"), (0.00284, "2.84 ms"),
                                           (0.0501, "50.1 ms"), (1.5, "1.5 s"), (9.18, "9.18 s"),
                                           (150, "2.5 min"), (9000, "2.5 h"), (0, "0 µs")])
def test_seconds_from_microseconds_to_hours(seconds, text):
    assert human_seconds(seconds) == text


def test_percent_never_rounds_a_small_fraction_to_zero():
    assert [human_percent(x) for x in (1.0, 0.5, 0.0149, 0.004, 0.0)] == ["100 %", "50 %", "1 %", "0.4 %", "0 %"]
    assert [human_percent(x, 1) for x in (0.4531, 0.0004)] == ["45.3 %", "0.04 %"]


def test_si_prefixes_for_rates():
    assert human_si(1.9e9, "B/s") == "1.9 GB/s"
    assert human_si(3.12e14, "FLOP/s") == "312 TFLOP/s"
    assert human_si(4.5e15, "FLOP/s") == "4.5 PFLOP/s"
