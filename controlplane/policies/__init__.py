"""Pure policies: what is decided (planner, tuner, gears, variants, drain, replay, the plan
document, the instance lifecycle, token scopes). No I/O, no clock reads: each returns data that a
loop or a use case acts on."""
