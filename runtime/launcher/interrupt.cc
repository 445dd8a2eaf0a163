// The interrupt thread: sigwait, remove swap and lock files, die of the signal.
#include "runtime/launcher/interrupt.h"

#include <pthread.h>
#include <signal.h>
#include <string.h>

#include <cstdio>
#include <thread>

#include "core/directory_lock.h"
#include "nvme/swap_space.h"

namespace strata::launcher {

void install_interrupt_cleanup(const std::string& program) {
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::thread([signals, program] {
    int sig = 0;
    while (sigwait(&signals, &sig) != 0) {
    }
    const uint64_t removed = nvme::SwapSpace::remove_live_files_for_exit();
    remove_lock_files_for_exit();
    std::fprintf(stderr, "%s: stopped by SIG%s; removed %.1f MB of swap files (strata.keep_swap_files keeps them), "
                 "checkpoints kept\n",
                 program.c_str(), sigabbrev_np(sig), static_cast<double>(removed) / 1e6);
    std::fflush(stderr);
    // Die of the signal itself: its default action, delivered to this thread.
    signal(sig, SIG_DFL);
    sigset_t only;
    sigemptyset(&only);
    sigaddset(&only, sig);
    pthread_sigmask(SIG_UNBLOCK, &only, nullptr);
    raise(sig);
  }).detach();
}

}  // namespace strata::launcher
