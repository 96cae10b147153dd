/* What a first touch of fresh anonymous memory costs on this machine: maps 16 MiB, writes one
 * byte per 4 KiB page, unmaps, 10 times; then the same with MADV_POPULATE_WRITE asking the kernel
 * to fault the range in with one call first; then with the range 2 MiB-aligned and advised
 * MADV_HUGEPAGE (transparent huge pages: one fault per 2 MiB where the kernel has one to give).
 * Prints microseconds per 4 KiB page. (bench/RESULTS.md, twenty-first session: ~2.5 us a page
 * on the AVX2 EPYC VM; sixty-second session: huge pages dearer than 4 KiB ones on the Zen 4 VM.)
 *
 *     cc -O2 -o /tmp/page_fault_cost bench/page_fault_cost.c && /tmp/page_fault_cost
 */
#include <stdint.h>
#include <stdio.h>
#include <sys/mman.h>
#include <time.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

int main(void) {
    const size_t size = 16u << 20, page = 4096, huge = 2u << 20;
    const int reps = 10;
    const char *mode[] = {"touch", "populate, then touch", "huge pages, touch"};
    for (int m = 0; m < 3; m++) {
        double total = 0;
        for (int r = 0; r < reps; r++) {
            /* One huge page more than needed, so that a 2 MiB-aligned 16 MiB lies inside. */
            char *raw = mmap(0, size + huge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                             -1, 0);
            if (raw == MAP_FAILED) {
                perror("mmap");
                return 1;
            }
            char *p = (char *)(((uintptr_t)raw + huge - 1) & ~((uintptr_t)huge - 1));
            double t = now();
            if (m == 1 && madvise(p, size, MADV_POPULATE_WRITE) != 0) perror("madvise");
            if (m == 2 && madvise(p, size, MADV_HUGEPAGE) != 0) perror("madvise");
            for (size_t i = 0; i < size; i += page) p[i] = 1;
            total += now() - t;
            munmap(raw, size + huge);
        }
        printf("%-22s %.3f us per 4 KiB page (%.2f ms per 16 MiB)\n", mode[m],
               total / reps * 1e6 / (size / page), total / reps * 1e3);
    }
    return 0;
}
