/* cython_kernels/fileio.h's coli_pread, checked on its own: built for Windows with mingw-w64 and
 * run under Wine by tests/test_portable_io.py where both are installed (the Windows branch cannot
 * run on Linux otherwise), and natively for the POSIX branch.
 * usage: pread_check FILE SIZE  -- FILE holds byte (i * 7 + i / 4096) & 255 at i < 65536 and the
 * marker "colibri" at SIZE - 7 (a sparse file past 4 GiB tests the high half of the offset). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <fcntl.h>
#ifdef _WIN32
#include <io.h>
#define OPEN_FLAGS (_O_RDONLY | _O_BINARY)
#else
#include <unistd.h>
#define OPEN_FLAGS O_RDONLY
#endif
#include "fileio.h"

static int fail(const char* what, long long a, long long b) {
    printf("FAIL %s: %lld %lld\n", what, a, b);
    return 1;
}

int main(int argc, char** argv) {
    if (argc != 3) return 2;
    long long size = atoll(argv[2]);
    int fd = open(argv[1], OPEN_FLAGS), err = 0;
    static unsigned char buf[70000];
    if (fd < 0) return fail("open", fd, 0);
    for (long long off = 0; off < 65536; off += 4093) {
        long long n = 1 + (off * 13) % 5000;
        if (off + n > 65536) n = 65536 - off;
        long long got = coli_pread(fd, buf, n, off, &err);
        if (got != n || err) return fail("read", got, n);
        for (long long i = 0; i < n; i++)
            if (buf[i] != (unsigned char)(((off + i) * 7 + (off + i) / 4096) & 255)) return fail("byte", off, i);
    }
    long long got = coli_pread(fd, buf, 64, size - 7, &err);          /* past the end: short */
    if (got != 7 || err || memcmp(buf, "colibri", 7)) return fail("tail", got, err);
    got = coli_pread(fd, buf, 64, size + 100, &err);                  /* at end of file: 0 */
    if (got != 0 || err) return fail("eof", got, err);
    close(fd);
    got = coli_pread(fd, buf, 8, 0, &err);                            /* a closed descriptor */
    if (got != -1 || err == 0) return fail("closed", got, err);
    printf("OK\n");
    return 0;
}
