"""hlo_liveness: the peak of a compiled program's live values, read from a buffer-assignment dump."""
import pytest

from revlib_xla.hlo_liveness import LivenessParseError, live_peak

# The shape of an XLA buffer-assignment dump (jax 0.7.1 + libtpu 0.0.20), cut down: a parameter, an output
# allocation that first holds a temporary ("a", parked there before the output "grad" is written), and a heap
# where "b" and its bitcast "b.view" alias one buffer and "c" reuses it later.
DUMP = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <0 Arg_0.1 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 100, output shape is |f32[25]|, maybe-live-out:
 value: <1 a @0> (size=100,offset=0): f32[25]{0}
 value: <2 grad @0> (size=100,offset=0): f32[25]{0}
allocation 2: size 300, preallocated-temp:
 value: <3 b @0> (size=200,offset=0): f32[50]{0}
 value: <4 b.view @0> (size=200,offset=0): f32[50]{0}
 value: <5 c @0> (size=200,offset=0): f32[50]{0}
 value: <6 d @1> (size=100,offset=200): f32[25]{0:S(1)}

Total bytes used: 464 (464B)

HloLiveRange (max 6):
  InstructionSequence:
    0:Arg_0.1
  BufferLiveRange:
    Arg_0.1{}:0-6
    a{}:1-3
    b{}:2-3
    b.view{}:3-3
    c{}:4-5
    grad{}:5-6
    d{}:1-6
"""


def test_live_peak_counts_each_buffer_once_and_skips_arguments_and_outputs():
    peak = live_peak(DUMP)
    assert (peak.bytes, peak.time, peak.schedule_length) == (300, 2, 6)  # a + b (b.view is b's buffer)
    assert peak.largest == (("b", 200), ("a", 100))
    assert live_peak(DUMP, memory_space=1).bytes == 0  # d is live at the end: an output


def test_live_peak_bad_input():
    with pytest.raises(LivenessParseError, match="no HloLiveRange"):
        live_peak("HloModule m")
    with pytest.raises(LivenessParseError, match="not an XLA buffer-assignment dump"):
        live_peak(DUMP.replace("Total bytes used", "Total"))
    with pytest.raises(LivenessParseError, match="value c has no live range"):
        live_peak(DUMP.replace("    c{}:4-5\n", ""))
