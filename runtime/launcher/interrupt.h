// What a rank process does when it is stopped by Ctrl-C (SIGINT) or SIGTERM
// (strata run forwards both to every rank): it removes the run's swap files —
// the whole training state on NVMe, terabytes at scale, useless without the
// process — unless strata.keep_swap_files asked to keep them, keeps its
// checkpoints (a checkpoint being written has no manifest yet and is ignored
// by --resume), removes its lock files, and dies of the signal, so the shell
// and strata run report 130 or 143.
//
// The signals are blocked in the calling thread, and so in every thread
// started after it; one thread of its own waits for them (sigwait), so the
// cleanup runs as ordinary code, not in a signal handler, while the other
// threads are wherever they are (their files are unlinked under them; the
// process exits right after).
//
// Thread-safety: call install_interrupt_cleanup() once, from the main thread,
// before any other thread is started. Errors: none (a cleanup that fails says
// so on stderr; the process still dies of the signal).
#pragma once

#include <string>

namespace strata::launcher {

// `program` names the process in the line it prints ("strata finetune").
void install_interrupt_cleanup(const std::string& program);

}  // namespace strata::launcher
