"""compiled.liveness: the peak of a compiled program's live values, read from a buffer-assignment dump."""

import pytest

from revlib_xla.compiled.liveness import (
    LivenessParseError,
    all_optimization_barrier_arguments,
    forward_backward_split,
    live_peak,
    optimization_barrier_arguments,
)

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


# A forward-then-backward program, cut down from a compiled stage: argument 0 is x, argument 1 the gradient dy.
# The forward computes h (kept for the backward) and y (returned); the backward starts at "g" (the first
# instruction that reads dy), makes a temporary "t" and the input gradient "dx" (returned).
SPLIT_HLO = """HloModule m

%fused (p: f32[4]) -> f32[4] {
  ROOT %p = f32[4]{0} parameter(0)
}

ENTRY %main (Arg_0.1: f32[16], Arg_1.2: f32[25]) -> (f32[16], f32[16]) {
  %Arg_0.1 = f32[16]{0} parameter(0)
  %Arg_1.2 = f32[25]{0} parameter(1)
  %h = f32[50]{0} fusion(%Arg_0.1), kind=kLoop, calls=%fused
  %y = f32[16]{0} fusion(%h, %Arg_0.1), kind=kLoop, calls=%fused
  %g = f32[25]{0} fusion(%Arg_1.2), kind=kLoop, calls=%fused
  %t = (f32[25]{0}, f32[50]{0}) fusion(%g, %h), kind=kLoop, calls=%fused
  %t.1 = f32[50]{0} get-tuple-element(%t), index=1
  %dx = f32[16]{0} fusion(%t.1, %y), kind=kLoop, calls=%fused
  ROOT %tuple = (f32[16]{0}, f32[16]{0}) tuple(%y, %dx)
}
"""

SPLIT_DUMP = """BufferAssignment:
allocation 0: size 64, parameter 0, shape |f32[16]| at ShapeIndex {}:
 value: <0 Arg_0.1 @0> (size=64,offset=0): f32[16]{0}
allocation 1: size 100, parameter 1, shape |f32[25]| at ShapeIndex {}:
 value: <1 Arg_1.2 @0> (size=100,offset=0): f32[25]{0}
allocation 2: size 64, output shape is |f32[16]|, maybe-live-out:
 value: <2 y @0> (size=64,offset=0): f32[16]{0}
allocation 3: size 64, output shape is |f32[16]|, maybe-live-out:
 value: <3 dx @0> (size=64,offset=0): f32[16]{0}
allocation 4: size 500, preallocated-temp:
 value: <4 h @0> (size=200,offset=0): f32[50]{0}
 value: <5 g @0> (size=100,offset=200): f32[25]{0}
 value: <6 t{1} @0> (size=200,offset=300): f32[50]{0}

Total bytes used: 792 (792B)

HloLiveRange (max 8):
  InstructionSequence:
    0:Arg_0.1
    1:Arg_1.2
    2:h
    3:y
    4:g
    5:t
    6:t.1
    7:dx
    8:tuple
  BufferLiveRange:
    Arg_0.1{}:0-8
    Arg_1.2{}:0-8
    h{}:2-5
    y{}:3-8
    g{}:4-5
    t{1}:5-7
    dx{}:7-8
"""


def test_forward_backward_split_cuts_at_the_first_instruction_that_reads_the_gradient():
    split = forward_backward_split(SPLIT_DUMP, SPLIT_HLO, [1], counted_outputs=[1], read_outputs=[0])
    assert split.time == 4  # g, the first user of argument 1
    assert split.before == 200  # h (y is an output)
    assert split.across == 200  # h, computed before g and read after
    assert split.after == 500  # h + g + t{1} at time 5
    assert split.after_with_outputs == 500  # dx (64 B) is computed at 7, when only t{1} (200 B) is live
    assert split.outputs_read == (True,)  # dx reads y
    # Without counting dx, and asking about dx: it is read by nobody but the root.
    assert forward_backward_split(SPLIT_DUMP, SPLIT_HLO, [1], read_outputs=[1]).outputs_read == (False,)


def test_forward_backward_split_bad_input():
    with pytest.raises(LivenessParseError, match="lacks some of the parameters"):
        forward_backward_split(SPLIT_DUMP, SPLIT_HLO, [5])
    with pytest.raises(LivenessParseError, match="returns 2 values"):
        forward_backward_split(SPLIT_DUMP, SPLIT_HLO, [1], counted_outputs=[2])
    with pytest.raises(LivenessParseError, match="no ENTRY"):
        forward_backward_split(SPLIT_DUMP, "HloModule m", [1])


def test_optimization_barrier_arguments():
    text = (
        "func.func @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {\n"
        "    %0 = stablehlo.sine %arg0 : tensor<4xf32>\n"
        "    %1:2 = stablehlo.optimization_barrier %0, %arg1 : tensor<4xf32>, tensor<4xf32>\n"
    )
    assert optimization_barrier_arguments(text) == [None, 1]
    with pytest.raises(LivenessParseError, match="no stablehlo.optimization_barrier"):
        optimization_barrier_arguments("func.func @main() {}")


def test_every_optimization_barrier_is_listed_in_text_order():
    text = (
        "func.func @main(%arg0: tensor<4xf32>, %arg1: tensor<4xf32>) -> tensor<4xf32> {\n"
        "    %0:2 = stablehlo.optimization_barrier %arg0, %arg1 : tensor<4xf32>, tensor<4xf32>\n"
        "    %1 = stablehlo.sine %0#0 : tensor<4xf32>\n"
        "    %2:3 = stablehlo.optimization_barrier %1, %0#1, %arg1 : tensor<4xf32>, tensor<4xf32>, tensor<4xf32>\n"
    )
    assert all_optimization_barrier_arguments(text) == [[0, 1], [None, None, 1]]
    assert optimization_barrier_arguments(text) == [0, 1]
    with pytest.raises(LivenessParseError, match="no stablehlo.optimization_barrier"):
        all_optimization_barrier_arguments("func.func @main() {}")
