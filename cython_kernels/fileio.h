/* Positioned reads on every OS, called without the GIL (qmatmul.pread_into).
 *
 * Python's os.pread / os.preadv exist only on POSIX: Windows' Python has neither, and its fallback
 * (seek + readinto under a lock) serialises the expert store's I/O threads. Here:
 *   POSIX:   pread(2), retried on EINTR and short reads;
 *   Windows: ReadFile on the descriptor's handle with the offset in an OVERLAPPED structure
 *            (a positional read on a synchronous handle: no shared file pointer to race on).
 * Returns the bytes read (fewer only at end of file), or -1 with the error in *err (errno on
 * POSIX, GetLastError() on Windows).
 */
#ifndef COLI_FILEIO_H
#define COLI_FILEIO_H

#include <stddef.h>
#include <stdint.h>

#ifdef _WIN32
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#include <io.h>

static int64_t coli_pread(int fd, void* buf, int64_t n, int64_t offset, int* err) {
    HANDLE h = (HANDLE)_get_osfhandle(fd);
    int64_t got = 0;
    *err = 0;
    if (h == INVALID_HANDLE_VALUE) {
        *err = ERROR_INVALID_HANDLE;
        return -1;
    }
    while (got < n) {
        int64_t left = n - got, at = offset + got;
        DWORD want = left > (1 << 30) ? (DWORD)(1 << 30) : (DWORD)left, k = 0;
        OVERLAPPED ov;
        ZeroMemory(&ov, sizeof ov);
        ov.Offset = (DWORD)((uint64_t)at & 0xFFFFFFFFu);
        ov.OffsetHigh = (DWORD)((uint64_t)at >> 32);
        if (!ReadFile(h, (char*)buf + got, want, &k, &ov)) {
            DWORD e = GetLastError();
            if (e == ERROR_HANDLE_EOF) break;
            *err = (int)e;
            return -1;
        }
        if (k == 0) break;
        got += k;
    }
    return got;
}

#else
#include <errno.h>
#include <unistd.h>

static int64_t coli_pread(int fd, void* buf, int64_t n, int64_t offset, int* err) {
    int64_t got = 0;
    *err = 0;
    while (got < n) {
        int64_t left = n - got;
        size_t want = left > (1 << 30) ? (size_t)(1 << 30) : (size_t)left;
        ssize_t k = pread(fd, (char*)buf + got, want, (off_t)(offset + got));
        if (k < 0) {
            if (errno == EINTR) continue;
            *err = errno;
            return -1;
        }
        if (k == 0) break;
        got += k;
    }
    return got;
}
#endif

#endif
