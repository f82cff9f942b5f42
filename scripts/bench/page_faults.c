/* What a first write to fresh anonymous memory costs on this machine, in seconds per GiB:
 * 1 GiB mapped, one byte written per 4 KiB page, unmapped; four rounds, with a pause between
 * them. On VMs whose balloon reports free memory to the host (virtio-balloon free page
 * reporting), huge pages given back and faulted in again seconds later are several times
 * dearer than ones freed a moment ago (kernels::alloc keeps its large blocks for this reason).
 *
 *   cc -O2 scripts/bench/page_faults.c -o /tmp/page_faults
 *   /tmp/page_faults 0 1   # huge pages (MADV_HUGEPAGE), no pause
 *   /tmp/page_faults 6 1   # huge pages, 6 s pause after each round
 *   /tmp/page_faults 6 0   # 4 KiB pages, 6 s pause
 */
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

static double now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(int argc, char **argv) {
  if (argc != 3) {
    fprintf(stderr, "usage: %s PAUSE_SECONDS HUGE(0|1)\n", argv[0]);
    return 2;
  }
  const size_t n = 1ul << 30, huge = 2ul << 20;
  int pause = atoi(argv[1]), advise = atoi(argv[2]);
  for (int round = 0; round < 4; round++) {
    char *raw = mmap(0, n + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (raw == MAP_FAILED) {
      perror("mmap");
      return 1;
    }
    char *p = (char *)(((size_t)raw + huge - 1) & ~(huge - 1));
    if (advise) madvise(p, n, MADV_HUGEPAGE);
    double t = now();
    for (size_t i = 0; i < n; i += 4096) p[i] = 1;
    double s = now() - t;
    munmap(raw, n + huge);
    printf("huge pages %d, pause %d s: %.3f s per GiB\n", advise, pause, s);
    fflush(stdout);
    sleep(pause);
  }
  return 0;
}
