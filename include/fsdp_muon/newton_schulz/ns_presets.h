#pragma once
// The Newton–Schulz coefficient presets (docs/DESIGN.md §4), as one table: the enum
// NsCoefficients, the preset names (to_string, parse_ns_coefficients), the schedules, their
// validation and the number of values a checkpoint archive accepts are all derived from it.
//
// Each row is X(enumerator, "name", rule, (a, b, c) tuples...), where rule is
//   kCycle       iteration i uses tuple i mod n
//   kRepeatLast  iteration i uses tuple min(i, n - 1)
//   kExactSteps  the schedule is defined for exactly n steps; other step counts are rejected
// A new preset is one row appended at the end: the enumerator's value is its row index, which
// checkpoints store, so rows are never reordered or removed.

#define FSDP_MUON_NS_PRESETS(X)                                                                    \
  X(kSimple, "simple", kRepeatLast, {3.4445, -4.7750, 2.0315})                                     \
  X(kQuintic, "quintic", kCycle, {4.0848, -6.8946, 2.9270}, {3.9505, -6.3029, 2.6377},             \
    {3.7418, -5.5913, 2.3037}, {2.8769, -3.1427, 1.2046}, {2.8366, -3.0525, 1.2012})               \
  X(kPolarExpress, "polar_express", kRepeatLast, {8.2051, -22.9019, 16.4607},                      \
    {4.0664, -2.8612, 0.5184}, {3.9096, -2.8234, 0.5250}, {3.2856, -2.4153, 0.4853},               \
    {2.2779, -1.6198, 0.3985}, {1.8726, -1.2307, 0.3585}, {1.8564, -1.2132, 0.3568},               \
    {1.8750, -1.2500, 0.3750})                                                                     \
  X(kCans, "cans", kRepeatLast, {8.4703, -25.1081, 18.6293}, {4.1828, -3.1087, 0.5806},            \
    {3.9619, -2.9541, 0.5630}, {3.2866, -2.4647, 0.5074}, {2.2737, -1.6447, 0.4162})               \
  X(kAol, "aol", kCycle, {4.0098, -7.0585, 2.4635}, {3.4585, -5.5479, 2.5959},                     \
    {2.7573, -3.2939, 1.4254}, {2.7215, -3.0494, 1.3169})                                          \
  /* 8 x simple, then the tail */                                                                  \
  X(kDeepseekV4, "deepseek_v4", kRepeatLast, {3.4445, -4.7750, 2.0315}, {3.4445, -4.7750, 2.0315}, \
    {3.4445, -4.7750, 2.0315}, {3.4445, -4.7750, 2.0315}, {3.4445, -4.7750, 2.0315},               \
    {3.4445, -4.7750, 2.0315}, {3.4445, -4.7750, 2.0315}, {3.4445, -4.7750, 2.0315},               \
    {2.0, -1.5, 0.5})                                                                              \
  X(kCubic5, "cubic5", kExactSteps, {3.3656576, -3.3420992, 0.0}, {2.5744352, -1.4957376, 0.0},    \
    {2.5368962, -1.4312570, 0.0}, {2.4418906, -1.2764040, 0.0}, {2.2230472, -0.9630650, 0.0})
