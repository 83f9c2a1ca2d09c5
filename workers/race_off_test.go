//go:build !race

package workers_test

// raceSlowdown scales the timings of tests whose work the race detector
// slows past them.
const raceSlowdown = 1
