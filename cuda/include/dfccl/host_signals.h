/* Helper threads of the host side (the simulator's streams and blocks, the
 * network proxy) block the asynchronous signals.  A signal sent to the
 * process (SIGTERM from a launcher, SIGINT) goes to one thread that does not
 * block it; Python runs its handlers only in the main thread, and a main
 * thread asleep in a system call is woken only by a signal delivered to it,
 * so one that landed on a helper thread would wait for the main thread's
 * next bytecode, for ever in `time.sleep`.  Faults a thread causes itself
 * (SIGSEGV, SIGBUS, ...) stay deliverable. */
#ifndef DFCCL_HOST_SIGNALS_H
#define DFCCL_HOST_SIGNALS_H

#include <pthread.h>
#include <signal.h>

static inline void dfccl_block_async_signals(void) {
  sigset_t set;
  sigfillset(&set);
  const int synchronous[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL, SIGABRT, SIGTRAP, SIGSYS};
  for (unsigned i = 0; i < sizeof(synchronous) / sizeof(synchronous[0]); ++i) sigdelset(&set, synchronous[i]);
  pthread_sigmask(SIG_BLOCK, &set, 0);
}

#endif
