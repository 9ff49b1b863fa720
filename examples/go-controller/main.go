// go-controller drives the sandbox command line the way a workshop controller written
// in Go would: a process per command, JSON lines on stdout, one meaning per exit code.
//
//	go-controller test WF STEP        test-run one step, printing each event as it happens
//	go-controller normal WF -- CMD... a normal (real) run of CMD under the workflow's shared lock
//
// The sandbox command is "sandbox" on PATH, or $SANDBOX. Standard library only.
package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"os/signal"
	"syscall"
)

// The exit codes of every sandbox command (docs: reference/exit-codes).
const (
	exitOK          = 0
	exitFailed      = 1
	exitUsage       = 2
	exitRefused     = 3
	exitConfig      = 4
	exitEnvironment = 5
	exitInternal    = 6
	exitRunError    = 7
	exitInterrupted = 130
)

// Event is one line of `--follow --json` (schema: sandbox/contracts/events.schema.json).
type Event struct {
	Kind      string   `json:"kind"`
	Time      string   `json:"time"`
	RunID     string   `json:"run_id"`
	StepID    string   `json:"step_id"`
	Decision  string   `json:"decision"`
	Tool      string   `json:"tool"`
	Reason    string   `json:"reason"`
	Status    string   `json:"status"`
	DurationS *float64 `json:"duration_s"`
}

// Record is the part of the run's record (the last line) this controller reads.
type Record struct {
	SchemaVersion int    `json:"schema_version"`
	ID            string `json:"id"`
	StepID        string `json:"step_id"`
	Status        string `json:"status"`
	Reason        string `json:"reason"`
}

// ErrorBody is what sandbox prints on stderr, as one JSON object, when a command fails
// in JSON mode.
type ErrorBody struct {
	Error struct {
		Kind    string `json:"kind"`
		Message string `json:"message"`
	} `json:"error"`
}

func sandboxCommand() string {
	if path := os.Getenv("SANDBOX"); path != "" {
		return path
	}
	return "sandbox"
}

func main() {
	if len(os.Args) >= 4 && os.Args[1] == "test" {
		os.Exit(testRun(os.Args[2], os.Args[3]))
	}
	if len(os.Args) >= 5 && os.Args[1] == "normal" && os.Args[3] == "--" {
		os.Exit(normalRun(os.Args[2], os.Args[4:]))
	}
	fmt.Fprintln(os.Stderr, "usage: go-controller test WF STEP | go-controller normal WF -- CMD [ARG...]")
	os.Exit(exitUsage)
}

// testRun runs `sandbox run WF STEP --json --follow`, prints each event as its line
// arrives, then decides on the exit code. It returns that exit code.
func testRun(workflow, step string) int {
	cmd := exec.Command(sandboxCommand(), "run", workflow, step, "--json", "--follow")
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		fmt.Fprintln(os.Stderr, "go-controller:", err)
		return exitInternal
	}
	if err := cmd.Start(); err != nil {
		fmt.Fprintln(os.Stderr, "go-controller: cannot start sandbox:", err)
		return exitEnvironment
	}
	// To cancel a run, signal the sandbox process: SIGTERM ends the run `killed`, its
	// record written and its containers removed, and sandbox exits 130.
	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGINT, syscall.SIGTERM)
	go func() {
		for range stop {
			_ = cmd.Process.Signal(syscall.SIGTERM)
		}
	}()

	var record *Record
	lines := bufio.NewReader(stdout)
	for {
		line, readErr := lines.ReadBytes('\n')
		if len(line) > 0 {
			if rec := handleLine(line); rec != nil {
				record = rec
			}
		}
		if readErr == io.EOF {
			break
		}
		if readErr != nil {
			fmt.Fprintln(os.Stderr, "go-controller: reading sandbox's output:", readErr)
			break
		}
	}
	code := exitCode(cmd.Wait())
	signal.Stop(stop)
	close(stop)
	if record == nil { // no record line: sandbox failed before the run (stderr says why)
		record = &Record{}
	}

	switch code {
	case exitOK:
		fmt.Printf("result: %s passed: the change can go on\n", record.StepID)
	case exitFailed:
		fmt.Printf("result: %s did not pass (%s): %s\n", record.StepID, record.Status, record.Reason)
	case exitRefused:
		fmt.Println("result: refused: a run holds the workflow; try again later")
	case exitRunError:
		fmt.Printf("result: the run ended error: %s\n", record.Reason)
	case exitInterrupted:
		fmt.Println("result: the run was stopped (killed); its record is written")
	default: // usage, config, environment, internal: one JSON object on stderr
		fmt.Printf("result: sandbox could not run it: %s\n", errorMessage(stderr.Bytes()))
	}
	return code
}

// handleLine parses one JSON line: an event is printed, the record is returned.
func handleLine(line []byte) *Record {
	var probe map[string]json.RawMessage
	if err := json.Unmarshal(line, &probe); err != nil {
		fmt.Fprintf(os.Stderr, "go-controller: not a JSON object: %q\n", line)
		return nil
	}
	if _, isRecord := probe["schema_version"]; isRecord {
		var record Record
		if err := json.Unmarshal(line, &record); err != nil {
			fmt.Fprintln(os.Stderr, "go-controller: bad record:", err)
			return nil
		}
		fmt.Printf("record %s: %s\n", record.ID, record.Status)
		return &record
	}
	var event Event
	if err := json.Unmarshal(line, &event); err != nil {
		fmt.Fprintln(os.Stderr, "go-controller: bad event:", err)
		return nil
	}
	switch event.Kind {
	case "action":
		// Tool names come from inside the sandbox: %q prints them escaped.
		fmt.Printf("event action %s %q\n", event.Decision, event.Tool)
	case "step_end", "workflow_end":
		fmt.Printf("event %s %s %s\n", event.Kind, event.StepID, event.Status)
	default:
		fmt.Printf("event %s %s\n", event.Kind, event.StepID)
	}
	return nil
}

// normalRun runs CMD as a normal (real) run of the workflow, holding its shared lock
// through `sandbox lock --shared`, so no test run starts while it works in the folder.
// CMD's own exit code comes back; 3 means a test run holds the workflow.
func normalRun(workflow string, command []string) int {
	args := append([]string{"lock", "--shared", workflow, "--owner", "go-controller", "--json", "--"}, command...)
	cmd := exec.Command(sandboxCommand(), args...)
	var stderr bytes.Buffer
	cmd.Stdin, cmd.Stdout = os.Stdin, os.Stdout
	cmd.Stderr = io.MultiWriter(os.Stderr, &stderr)
	code := exitCode(cmd.Run())
	if code == exitRefused {
		fmt.Printf("normal run refused: %s\n", errorMessage(stderr.Bytes()))
	} else {
		fmt.Printf("normal run exited %d\n", code)
	}
	return code
}

func exitCode(err error) int {
	var exitErr *exec.ExitError
	switch {
	case err == nil:
		return exitOK
	case errors.As(err, &exitErr):
		if status, ok := exitErr.Sys().(syscall.WaitStatus); ok && status.Signaled() {
			return 128 + int(status.Signal())
		}
		return exitErr.ExitCode()
	default:
		return exitEnvironment
	}
}

// errorMessage is the message of the JSON error object on stderr (its last line).
func errorMessage(stderr []byte) string {
	lines := bytes.Split(bytes.TrimSpace(stderr), []byte("\n"))
	var body ErrorBody
	if err := json.Unmarshal(lines[len(lines)-1], &body); err != nil || body.Error.Kind == "" {
		return string(bytes.TrimSpace(stderr))
	}
	return body.Error.Kind + ": " + body.Error.Message
}
