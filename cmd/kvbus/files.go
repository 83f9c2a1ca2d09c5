package main

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// outputFile is a file written under a temporary name in its directory and
// renamed into place by commit: a run that fails leaves an existing file
// as it was (a failed capture truncated the capture it was to replace).
type outputFile struct {
	*os.File
	path string
}

func createOutput(path string) (*outputFile, error) {
	// A directory was found only by the rename at the end (capture --out
	// /tmp: "rename /.tmp.….partial /tmp: file exists"; replay --json DIR:
	// "is a directory" after the whole replay).
	if fi, err := os.Stat(path); err == nil && fi.IsDir() {
		return nil, fmt.Errorf("cannot write %s: it is a directory; give a file in it, e.g. %s", path, filepath.Join(path, "out"+filepath.Ext(path)))
	}
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.partial")
	if err != nil {
		return nil, fmt.Errorf("cannot write %s: %w", path, err)
	}
	return &outputFile{File: f, path: path}, nil
}

// commit closes the file and renames it to its path.
func (o *outputFile) commit() error {
	err := o.Chmod(0o644) // as a file os.Create makes under the usual umask
	if cerr := o.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(o.Name(), o.path)
	}
	if err != nil {
		_ = os.Remove(o.Name())
		return fmt.Errorf("cannot write %s: %w", o.path, err)
	}
	return nil
}

// discard closes and removes the file; the path keeps what it held.
func (o *outputFile) discard() {
	_ = o.Close()
	_ = os.Remove(o.Name())
}

// checkOutputs fails when a path given for a report cannot be written, so
// that a run of minutes does not end by losing its report.
func checkOutputs(flags map[string]string) error {
	var errs []error
	for flag, path := range flags {
		if path == "" {
			continue
		}
		o, err := createOutput(path)
		if err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", flag, err))
			continue
		}
		o.discard()
	}
	return errors.Join(errs...)
}
