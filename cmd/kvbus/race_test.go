//go:build race

package main

// raceBuild builds the binary under test with -race when the tests run
// with it: the packages are then already compiled, and the binary checks
// for races too.
const raceBuild = true
