// lmgen: the footprint benchmark's load generator (bench/footprint.py builds and runs it).
//
// It is C so that on a small machine its own CPU does not compete with the agent it loads:
// on a node the probes come from other machines. It does no cryptography: footprint.py signs
// every probe beforehand (each stamped with the wall-clock time it is due to leave) and checks
// and decodes every answer afterwards with the agent's own wire codec.
//
//   lmgen DST_IP DST_PORT RATE START_REALTIME_NS IN OUT_SEND OUT_RECV LINGER_MS [SRC_PORT]
//
// IN: the probes, each a little-endian u16 length and that many bytes. One UDP socket is
// bound to SRC_PORT (default: an ephemeral port) and shared by two processes: the agent takes a
// member's datagrams only from the address and port of its zone.nodes entry (wrong_source), so
// the probes of "node 2" leave from node 2's port. The child sends the probes at RATE
// per second from START_REALTIME_NS on, reading CLOCK_MONOTONIC just before each sendto and
// taking the kernel's software TX timestamp of each from the socket's error queue
// (SO_TIMESTAMPING with OPT_ID: numbered per successful send); it writes OUT_SEND: per probe
// three little-endian i64: the monotonic send time (ns), the TX stamp (CLOCK_REALTIME ns, 0 if
// none), 1 if the send succeeded else 0. The parent receives the answers until LINGER_MS after
// the child is done, with the kernel's RX stamp of each (SO_TIMESTAMPNS), and writes OUT_RECV:
// per answer i64 RX stamp (CLOCK_REALTIME ns, 0 if none), i64 CLOCK_MONOTONIC at the read,
// u16 length, the bytes. Exit 0 on success, 1 with a message on stderr otherwise.
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <linux/errqueue.h>
#include <linux/net_tstamp.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static int64_t now_ns(clockid_t c) {
    struct timespec ts;
    clock_gettime(c, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static void die(const char *what) {
    perror(what);
    exit(1);
}

static void *xalloc(void *p) {
    if (!p) {
        fprintf(stderr, "lmgen: out of memory\n");
        exit(1);
    }
    return p;
}

static void drain_tx(int fd, int64_t *tx_by_key, size_t nkeys) {
    char ctrl[512];
    for (;;) {
        struct msghdr m = {0};
        m.msg_control = ctrl;
        m.msg_controllen = sizeof ctrl;
        if (recvmsg(fd, &m, MSG_ERRQUEUE | MSG_DONTWAIT) < 0)
            return;
        int64_t ts = 0;
        int64_t key = -1;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c)) {
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_TIMESTAMPING) {
                struct timespec t[3];
                memcpy(t, CMSG_DATA(c), sizeof t);
                ts = (int64_t)t[0].tv_sec * 1000000000LL + t[0].tv_nsec;
            } else if (c->cmsg_level == SOL_IP && c->cmsg_type == IP_RECVERR) {
                struct sock_extended_err e;
                memcpy(&e, CMSG_DATA(c), sizeof e);
                if (e.ee_origin == SO_EE_ORIGIN_TIMESTAMPING)
                    key = e.ee_data;
            }
        }
        if (key >= 0 && (size_t)key < nkeys && ts)
            tx_by_key[key] = ts;
    }
}

static int sender(int fd, struct sockaddr_in *dst, long rate, int64_t start_real, const char *in, const char *out) {
    FILE *f = fopen(in, "rb");
    if (!f)
        die(in);
    size_t cap = 1 << 16, n = 0;
    unsigned char **dg = xalloc(malloc(cap * sizeof *dg));
    uint16_t *len = xalloc(malloc(cap * sizeof *len));
    unsigned char hdr[2];
    while (fread(hdr, 1, 2, f) == 2) {
        if (n == cap) {
            cap *= 2;
            dg = xalloc(realloc(dg, cap * sizeof *dg));
            len = xalloc(realloc(len, cap * sizeof *len));
        }
        len[n] = (uint16_t)(hdr[0] | hdr[1] << 8);
        dg[n] = xalloc(malloc(len[n] ? len[n] : 1));
        if (fread(dg[n], 1, len[n], f) != len[n]) {
            fprintf(stderr, "lmgen: %s: truncated probe %zu\n", in, n);
            return 1;
        }
        n++;
    }
    fclose(f);
    int64_t *send_ns = xalloc(calloc(n + 1, sizeof *send_ns)), *ok = xalloc(calloc(n + 1, sizeof *ok));
    int64_t *tx_by_key = xalloc(calloc(n + 1, sizeof *tx_by_key));
    size_t *key_of = xalloc(calloc(n + 1, sizeof *key_of));  // the kernel's number of each probe's send
    int flags = SOF_TIMESTAMPING_TX_SOFTWARE | SOF_TIMESTAMPING_SOFTWARE | SOF_TIMESTAMPING_OPT_ID |
                SOF_TIMESTAMPING_OPT_TSONLY;
    if (setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPING, &flags, sizeof flags) < 0)
        die("SO_TIMESTAMPING");
    // start at START_REALTIME_NS, then pace on CLOCK_MONOTONIC
    int64_t wait = start_real - now_ns(CLOCK_REALTIME);
    if (wait > 0) {
        struct timespec w = {wait / 1000000000LL, wait % 1000000000LL};
        nanosleep(&w, NULL);
    }
    int64_t t0 = now_ns(CLOCK_MONOTONIC), interval = 1000000000LL / rate;
    size_t k = 0, keys = 0;
    while (k < n) {
        int64_t due = (now_ns(CLOCK_MONOTONIC) - t0) / interval + 1;
        while (k < n && (int64_t)k < due) {
            send_ns[k] = now_ns(CLOCK_MONOTONIC);
            if (sendto(fd, dg[k], len[k], 0, (struct sockaddr *)dst, sizeof *dst) == len[k]) {
                ok[k] = 1;
                key_of[k] = keys++;
            }
            k++;
        }
        drain_tx(fd, tx_by_key, n + 1);
        int64_t next = t0 + (int64_t)k * interval;
        struct timespec w = {next / 1000000000LL, next % 1000000000LL};
        clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &w, NULL);
    }
    struct timespec w = {0, 50000000};
    nanosleep(&w, NULL);
    drain_tx(fd, tx_by_key, n + 1);
    FILE *o = fopen(out, "wb");
    if (!o)
        die(out);
    for (size_t i = 0; i < n; i++) {
        int64_t rec[3] = {send_ns[i], ok[i] ? tx_by_key[key_of[i]] : 0, ok[i]};
        fwrite(rec, sizeof rec, 1, o);
    }
    if (fclose(o) != 0)
        die(out);
    return 0;
}

int main(int argc, char **argv) {
    if (argc != 9 && argc != 10) {
        fprintf(stderr, "usage: lmgen DST_IP DST_PORT RATE START_REALTIME_NS IN OUT_SEND OUT_RECV LINGER_MS [SRC_PORT]\n");
        return 1;
    }
    struct sockaddr_in dst = {.sin_family = AF_INET, .sin_port = htons((uint16_t)atoi(argv[2]))};
    if (inet_pton(AF_INET, argv[1], &dst.sin_addr) != 1) {
        fprintf(stderr, "lmgen: %s: not an IPv4 address\n", argv[1]);
        return 1;
    }
    long rate = atol(argv[3]);
    if (rate <= 0 || rate > 1000000) {
        fprintf(stderr, "lmgen: rate %s: must be 1..1000000\n", argv[3]);
        return 1;
    }
    int64_t start_real = atoll(argv[4]);
    long linger_ms = atol(argv[8]);
    int fd = socket(AF_INET, SOCK_DGRAM, 0);
    if (fd < 0)
        die("socket");
    int rcvbuf = 4 << 20, on = 1;
    setsockopt(fd, SOL_SOCKET, SO_RCVBUFFORCE, &rcvbuf, sizeof rcvbuf);
    if (setsockopt(fd, SOL_SOCKET, SO_TIMESTAMPNS, &on, sizeof on) < 0)
        die("SO_TIMESTAMPNS");
    struct sockaddr_in any = {.sin_family = AF_INET, .sin_port = htons((uint16_t)(argc == 10 ? atoi(argv[9]) : 0))};
    if (bind(fd, (struct sockaddr *)&any, sizeof any) < 0)
        die("bind");
    pid_t child = fork();
    if (child < 0)
        die("fork");
    if (child == 0)
        _exit(sender(fd, &dst, rate, start_real, argv[5], argv[6]));
    struct timeval tv = {0, 200000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    FILE *o = fopen(argv[7], "wb");
    if (!o)
        die(argv[7]);
    static char buf[1 << 16];
    char ctrl[256];
    int status = 0;
    int64_t end = 0;
    for (;;) {
        if (!end && waitpid(child, &status, WNOHANG) == child)
            end = now_ns(CLOCK_MONOTONIC) + linger_ms * 1000000LL;
        if (end && now_ns(CLOCK_MONOTONIC) >= end)
            break;
        struct iovec iov = {buf, sizeof buf};
        struct msghdr m = {0};
        m.msg_iov = &iov;
        m.msg_iovlen = 1;
        m.msg_control = ctrl;
        m.msg_controllen = sizeof ctrl;
        ssize_t r = recvmsg(fd, &m, 0);
        if (r < 0) {
            if (errno == EAGAIN || errno == EINTR || errno == ECONNREFUSED)
                continue;
            die("recvmsg");
        }
        int64_t rec[2] = {0, now_ns(CLOCK_MONOTONIC)};
        for (struct cmsghdr *c = CMSG_FIRSTHDR(&m); c; c = CMSG_NXTHDR(&m, c))
            if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_TIMESTAMPNS) {
                struct timespec t;
                memcpy(&t, CMSG_DATA(c), sizeof t);
                rec[0] = (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
            }
        uint16_t l = (uint16_t)r;
        fwrite(rec, sizeof rec, 1, o);
        fwrite(&l, sizeof l, 1, o);
        fwrite(buf, 1, l, o);
    }
    if (fclose(o) != 0)
        die(argv[7]);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        fprintf(stderr, "lmgen: the sender failed (status %d)\n", status);
        return 1;
    }
    return 0;
}
