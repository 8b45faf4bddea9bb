// SPDX-License-Identifier: GPL-2.0-or-later
/*
 * laminar_spank.c: hands each task of a Slurm job to its node's laminard for adoption
 * (docs/slurm.md).
 *
 *   plugstack.conf:  required /path/laminar_spank.so socket=/run/laminar/laminard.sock
 *                    [adopt=all] [wait=15] [unreachable=fail|run]
 *   srun/sbatch:     --laminar-class=NAME --laminar-priority=N --laminar-checkpoint=SIG|none
 *
 * Local (srun) and allocator (sbatch, salloc) context: the options' syntax is checked, then the
 * local agent, when its socket exists, is asked POST /v1/jobs/adopt/check; a refusal fails the
 * command with "laminar: <reason>" before the job is queued.
 * Remote context (slurmstepd): slurm_spank_task_init, in the task's own process as the job's user
 * just before it execs, POSTs /v1/jobs/adopt with the task's pid, the job's uid, gid and id, its GPUs
 * and the options, then sets the env the agent answers (LAMINAR_JOB_ID, LAMINAR_CKPT_DIR, ...).
 * A job without any --laminar-* option is left alone unless the plugin argument adopt=all.
 * A node whose agent does not listen (stopped, restarting) is tried again for wait= seconds; then
 * the task fails (unreachable=fail, the default: a job that asked for Laminar's protection does
 * not run without it unseen), or runs without Laminar, saying so on its stderr (unreachable=run).
 * An agent that answers with a refusal fails the task whatever unreachable= says.
 *
 * The agent speaks HTTP/1.1 + JSON on a Unix socket. The client here is written by hand: one
 * request per connection (the agent answers "Connection: close"), the answer read up to
 * MAX_ANSWER bytes, every wait bounded by TIMEOUT_MS. Of the JSON answer only the "env" object
 * (string to string) and the "error" string are read.
 */

#include <ctype.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/types.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <slurm/spank.h>

SPANK_PLUGIN(laminar, 1);

/* The agent's answer to one request: its largest reasonable size (a job record and a few env
 * names) is a few KiB; anything beyond 64 KiB is not an answer we will parse. */
#define MAX_ANSWER (64 * 1024)
/* A step's launch waits on this call: 10 s is far beyond a healthy agent's answer (ms) and
 * short enough that a hung agent does not hold a launch past Slurm's own timeouts. */
#define TIMEOUT_MS 10000
#define MAX_ENV 32          /* env names the agent may set on the task */
#define MAX_JSON_DEPTH 16   /* nesting skipped in answers before we give up */
#define MAX_GPUS 64
#define DEFAULT_SOCKET "/run/laminar/laminard.sock"
/* How long a task tries again to reach a node's agent that does not listen: an agent's restart
 * (systemd's Restart=, an upgrade) takes a few seconds; a task's launch can wait that long. */
#define DEFAULT_WAIT_S 15
#define MAX_WAIT_S 300
#define RETRY_MS 250

static char opt_class[64];
static int opt_priority = -1;          /* -1: not given (the agent's default) */
static char opt_checkpoint[32];
static int opt_any;                    /* a --laminar-* option was given */

static char arg_socket[108] = DEFAULT_SOCKET;  /* sizeof(sun_path) */
static int arg_adopt_all;
static int arg_wait_s = DEFAULT_WAIT_S;
static int arg_unreachable_run;       /* unreachable=run: a task the agent cannot be asked about runs */

/* -------------------------------------------------------------------- option syntax */

/* A class name: 1..63 of [A-Za-z0-9_.-], starting with a letter or digit. Whether the class
 * exists and the user may use it is the agent's word (check, adopt). */
static int valid_class(const char *s)
{
	size_t n = strlen(s);
	if (n == 0 || n >= sizeof(opt_class) || !isalnum((unsigned char)s[0]))
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)s[i]) && s[i] != '-' && s[i] != '_' && s[i] != '.')
			return 0;
	return 1;
}

/* A checkpoint signal: "none", a name (USR1, SIGUSR2) or a number 1..64; the agent checks it
 * names a signal a job can catch. */
static int valid_checkpoint(const char *s)
{
	size_t n = strlen(s);
	if (n == 0 || n >= sizeof(opt_checkpoint))
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)s[i]))
			return 0;
	return 1;
}

static int cb_class(int val, const char *optarg, int remote)
{
	(void)val;
	if (!optarg || !valid_class(optarg)) {
		slurm_error("laminar: --laminar-class %s: expected a class name such as long-resident, "
			    "standard or transient", optarg ? optarg : "(none)");
		return -1;
	}
	snprintf(opt_class, sizeof(opt_class), "%s", optarg);
	opt_any = 1;
	(void)remote;
	return 0;
}

static int cb_priority(int val, const char *optarg, int remote)
{
	char *end = NULL;
	long v;
	(void)val;
	(void)remote;
	errno = 0;
	v = optarg ? strtol(optarg, &end, 10) : -1;
	if (!optarg || !*optarg || errno || *end || v < 0 || v > 100) {
		slurm_error("laminar: --laminar-priority %s: expected an integer 0..100 (higher survives longer)",
			    optarg ? optarg : "(none)");
		return -1;
	}
	opt_priority = (int)v;
	opt_any = 1;
	return 0;
}

static int cb_checkpoint(int val, const char *optarg, int remote)
{
	(void)val;
	(void)remote;
	if (!optarg || !valid_checkpoint(optarg)) {
		slurm_error("laminar: --laminar-checkpoint %s: expected a signal name such as USR1 or none",
			    optarg ? optarg : "(none)");
		return -1;
	}
	snprintf(opt_checkpoint, sizeof(opt_checkpoint), "%s", optarg);
	opt_any = 1;
	return 0;
}

/* Registered in slurm_spank_init, not exported as the static `spank_options` table: sbatch and
 * salloc (allocator context) ignore that table, so the options would be unknown to sbatch. */
static struct spank_option laminar_options[] = {
	{"laminar-class", "NAME", "Laminar job class (long-resident, standard, transient)", 1, 0, cb_class},
	{"laminar-priority", "N", "Laminar priority 0..100 within the class (higher survives longer)", 1, 0,
	 cb_priority},
	{"laminar-checkpoint", "SIG", "signal the job catches to checkpoint (default USR1), or none", 1, 0,
	 cb_checkpoint},
	SPANK_OPTIONS_TABLE_END
};

/* ------------------------------------------------------------------ plugin arguments */

static int parse_args(int ac, char **av)
{
	for (int i = 0; i < ac; i++) {
		if (strncmp(av[i], "socket=", 7) == 0) {
			const char *p = av[i] + 7;
			if (p[0] != '/' || strlen(p) >= sizeof(arg_socket)) {
				slurm_error("laminar: plugin argument socket=%s: expected an absolute path under %zu bytes",
					    p, sizeof(arg_socket));
				return -1;
			}
			snprintf(arg_socket, sizeof(arg_socket), "%s", p);
		} else if (strcmp(av[i], "adopt=all") == 0) {
			arg_adopt_all = 1;
		} else if (strcmp(av[i], "adopt=opt-in") == 0) {
			arg_adopt_all = 0;
		} else if (strncmp(av[i], "wait=", 5) == 0) {
			char *end;
			long v;
			errno = 0;
			v = strtol(av[i] + 5, &end, 10);
			if (!av[i][5] || *end || errno || v < 0 || v > MAX_WAIT_S) {
				slurm_error("laminar: plugin argument %s: expected wait=SECONDS, 0 to %d", av[i],
					    MAX_WAIT_S);
				return -1;
			}
			arg_wait_s = (int)v;
		} else if (strcmp(av[i], "unreachable=fail") == 0) {
			arg_unreachable_run = 0;
		} else if (strcmp(av[i], "unreachable=run") == 0) {
			arg_unreachable_run = 1;
		} else {
			slurm_error("laminar: unknown plugin argument %s (expected socket=PATH, adopt=all, adopt=opt-in, "
				    "wait=SECONDS or unreachable=fail|run)", av[i]);
			return -1;
		}
	}
	return 0;
}

/* --------------------------------------------------------------------- HTTP client */

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Waits until fd is ready for `events` or the deadline passes: 0 ready, -1 otherwise. */
static int wait_fd(int fd, short events, long long deadline)
{
	for (;;) {
		long long left = deadline - now_ms();
		struct pollfd p = {.fd = fd, .events = events};
		int r;
		if (left <= 0)
			return -1;
		r = poll(&p, 1, (int)left);
		if (r > 0)
			return 0;
		if (r == 0 || errno != EINTR)
			return -1;
	}
}

/* One request to the agent. Returns the HTTP status (the body, NUL-terminated, in *body, to be
 * freed), or -1 with the reason in err: NO_AGENT when no agent listens there (no socket file, or
 * a socket nobody listens on: a stopped agent's). */
#define NO_AGENT (-2)
#define UNANSWERED (-3) /* connected, but no answer within TIMEOUT_MS (a hung agent) */
static int http_post(const char *path, const char *json, char **body, char *err, size_t errlen)
{
	struct sockaddr_un sa = {.sun_family = AF_UNIX};
	long long deadline = now_ms() + TIMEOUT_MS;
	char head[512];
	char *buf = NULL, *sep;
	size_t len = 0, jlen = strlen(json);
	int fd, status = -1, hl;

	*body = NULL;
	snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", arg_socket);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0) {
		snprintf(err, errlen, "socket: %s", strerror(errno));
		return -1;
	}
	/* A Unix socket's connect waits while the agent's backlog is full, bounded by SO_SNDTIMEO
	 * (a non-blocking one would fail at once with EAGAIN instead); the rest is non-blocking. */
	{
		struct timeval tv = {.tv_sec = TIMEOUT_MS / 1000, .tv_usec = (TIMEOUT_MS % 1000) * 1000};
		if (setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) < 0 ||
		    connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
			if (errno == ENOENT || errno == ECONNREFUSED)
				status = NO_AGENT;
			else if (errno == EAGAIN || errno == EWOULDBLOCK)
				status = UNANSWERED;
			snprintf(err, errlen, "cannot reach the agent at %s: %s", arg_socket,
				 errno == EAGAIN || errno == EWOULDBLOCK ? "busy (connect timed out)" : strerror(errno));
			goto out;
		}
		if (fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK) < 0) {
			snprintf(err, errlen, "fcntl: %s", strerror(errno));
			goto out;
		}
	}
	hl = snprintf(head, sizeof(head),
		      "POST %s HTTP/1.1\r\nHost: laminar\r\nContent-Type: application/json\r\n"
		      "Content-Length: %zu\r\nConnection: close\r\n\r\n", path, jlen);
	for (int part = 0; part < 2; part++) {
		const char *p = part ? json : head;
		size_t left = part ? jlen : (size_t)hl;
		while (left) {
			ssize_t w;
			if (wait_fd(fd, POLLOUT, deadline) < 0) {
				snprintf(err, errlen, "the agent at %s did not take the request in %d ms", arg_socket,
					 TIMEOUT_MS);
				status = UNANSWERED;
				goto out;
			}
			w = send(fd, p, left, MSG_NOSIGNAL);
			if (w < 0) {
				if (errno == EINTR || errno == EAGAIN)
					continue;
				snprintf(err, errlen, "cannot reach the agent at %s: %s", arg_socket, strerror(errno));
				goto out;
			}
			p += w;
			left -= (size_t)w;
		}
	}
	buf = malloc(MAX_ANSWER + 1);
	if (!buf) {
		snprintf(err, errlen, "out of memory");
		goto out;
	}
	for (;;) {
		ssize_t r;
		if (len == MAX_ANSWER) {
			snprintf(err, errlen, "the agent's answer is over %d bytes", MAX_ANSWER);
			goto out;
		}
		if (wait_fd(fd, POLLIN, deadline) < 0) {
			snprintf(err, errlen, "no answer from the agent at %s in %d ms", arg_socket, TIMEOUT_MS);
			status = UNANSWERED;
			goto out;
		}
		r = recv(fd, buf + len, MAX_ANSWER - len, 0);
		if (r == 0)
			break;
		if (r < 0) {
			if (errno == EINTR || errno == EAGAIN)
				continue;
			snprintf(err, errlen, "reading the agent's answer: %s", strerror(errno));
			goto out;
		}
		len += (size_t)r;
	}
	buf[len] = '\0';
	if (len < 12 || strncmp(buf, "HTTP/1.", 7) != 0 || !isdigit((unsigned char)buf[9]) ||
	    !(sep = strstr(buf, "\r\n\r\n"))) {
		snprintf(err, errlen, "the agent's answer is not HTTP");
		goto out;
	}
	status = atoi(buf + 9);
	memmove(buf, sep + 4, len - (size_t)(sep + 4 - buf) + 1);
	*body = buf;
	buf = NULL;
out:
	free(buf);
	close(fd);
	return status;
}

/* ------------------------------------------------------------------ JSON, the least */

struct env_pair {
	char name[128];
	char value[4096]; /* PATH_MAX: LAMINAR_CKPT_DIR, LAMINAR_RESUME_FROM */
};

struct answer {
	char error[512];
	struct env_pair env[MAX_ENV];
	int nenv;
};

static const char *skip_ws(const char *p)
{
	while (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')
		p++;
	return p;
}

static int hexval(char c)
{
	if (c >= '0' && c <= '9')
		return c - '0';
	if (c >= 'a' && c <= 'f')
		return c - 'a' + 10;
	if (c >= 'A' && c <= 'F')
		return c - 'A' + 10;
	return -1;
}

/* Set by read_string when a string did not fit its buffer. */
static int json_truncated;

/* Reads a JSON string at p (at its opening quote) into out (at most outlen - 1 bytes, the rest
 * dropped and json_truncated set; out may be NULL to skip it). Returns the position after the
 * closing quote, or NULL. */
static const char *read_string(const char *p, char *out, size_t outlen)
{
	size_t n = 0;
	if (*p != '"')
		return NULL;
	p++;
	while (*p && *p != '"') {
		unsigned cp = 0;
		char tmp[4];
		int tl = 1;
		if ((unsigned char)*p < 0x20)
			return NULL;
		if (*p != '\\') {
			tmp[0] = *p++;
		} else {
			p++;
			switch (*p) {
			case '"': case '\\': case '/': tmp[0] = *p; break;
			case 'b': tmp[0] = '\b'; break;
			case 'f': tmp[0] = '\f'; break;
			case 'n': tmp[0] = '\n'; break;
			case 'r': tmp[0] = '\r'; break;
			case 't': tmp[0] = '\t'; break;
			case 'u':
				cp = 0;
				for (int i = 1; i <= 4; i++) {
					int h = hexval(p[i]);
					if (h < 0)
						return NULL;
					cp = cp * 16 + (unsigned)h;
				}
				p += 4;
				/* a lone or paired surrogate: not for env values; written as '?' */
				if (cp >= 0xD800 && cp <= 0xDFFF)
					cp = '?';
				if (cp < 0x80) {
					tmp[0] = (char)cp;
				} else if (cp < 0x800) {
					tmp[0] = (char)(0xC0 | (cp >> 6));
					tmp[1] = (char)(0x80 | (cp & 0x3F));
					tl = 2;
				} else {
					tmp[0] = (char)(0xE0 | (cp >> 12));
					tmp[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
					tmp[2] = (char)(0x80 | (cp & 0x3F));
					tl = 3;
				}
				break;
			default:
				return NULL;
			}
			p++;
		}
		for (int i = 0; out && i < tl; i++) {
			if (n + 1 < outlen)
				out[n++] = tmp[i];
			else
				json_truncated = 1;
		}
	}
	if (*p != '"')
		return NULL;
	if (out && outlen)
		out[n] = '\0';
	return p + 1;
}

/* Skips one JSON value of any kind; NULL on malformed input or nesting beyond MAX_JSON_DEPTH. */
static const char *skip_value(const char *p, int depth)
{
	p = skip_ws(p);
	if (depth > MAX_JSON_DEPTH)
		return NULL;
	if (*p == '"')
		return read_string(p, NULL, 0);
	if (*p == '{' || *p == '[') {
		char close = *p == '{' ? '}' : ']';
		p = skip_ws(p + 1);
		if (*p == close)
			return p + 1;
		for (;;) {
			if (close == '}') {
				p = read_string(skip_ws(p), NULL, 0);
				if (!p || *(p = skip_ws(p)) != ':')
					return NULL;
				p++;
			}
			p = skip_value(p, depth + 1);
			if (!p)
				return NULL;
			p = skip_ws(p);
			if (*p == close)
				return p + 1;
			if (*p != ',')
				return NULL;
			p++;
		}
	}
	/* number, true, false, null */
	if (!*p || !strchr("-0123456789tfn", *p))
		return NULL;
	while (*p && (isalnum((unsigned char)*p) || *p == '-' || *p == '+' || *p == '.'))
		p++;
	return p;
}

/* The "env" object: string values only (anything else there is refused). */
static const char *read_env(const char *p, struct answer *a)
{
	p = skip_ws(p);
	if (*p != '{')
		return NULL;
	p = skip_ws(p + 1);
	if (*p == '}')
		return p + 1;
	for (;;) {
		struct env_pair *e;
		if (a->nenv >= MAX_ENV)
			return NULL;
		e = &a->env[a->nenv];
		json_truncated = 0;
		p = read_string(skip_ws(p), e->name, sizeof(e->name));
		if (!p || *(p = skip_ws(p)) != ':')
			return NULL;
		p = read_string(skip_ws(p + 1), e->value, sizeof(e->value));
		if (!p || json_truncated) /* a cut path is a wrong path: no env at all */
			return NULL;
		a->nenv++;
		p = skip_ws(p);
		if (*p == '}')
			return p + 1;
		if (*p != ',')
			return NULL;
		p++;
	}
}

/* Reads the top-level object's "env" and "error"; -1 when the text is not such an object. */
static int parse_answer(const char *text, struct answer *a)
{
	const char *p = skip_ws(text);
	memset(a, 0, sizeof(*a));
	if (*p != '{')
		return -1;
	p = skip_ws(p + 1);
	if (*p == '}')
		return 0;
	for (;;) {
		char key[32];
		p = read_string(skip_ws(p), key, sizeof(key));
		if (!p || *(p = skip_ws(p)) != ':')
			return -1;
		p = skip_ws(p + 1);
		if (strcmp(key, "env") == 0)
			p = read_env(p, a);
		else if (strcmp(key, "error") == 0 && *p == '"')
			p = read_string(p, a->error, sizeof(a->error));
		else
			p = skip_value(p, 1);
		if (!p)
			return -1;
		p = skip_ws(p);
		if (*p == '}')
			return 0;
		if (*p != ',')
			return -1;
		p++;
	}
}

/* ---------------------------------------------------------------------- the request */

struct body {
	char text[1024];
	size_t len;
	int overflow;
};

static void add(struct body *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void add(struct body *b, const char *fmt, ...)
{
	va_list ap;
	int n;
	if (b->overflow)
		return;
	va_start(ap, fmt);
	n = vsnprintf(b->text + b->len, sizeof(b->text) - b->len, fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= sizeof(b->text) - b->len)
		b->overflow = 1;
	else
		b->len += (size_t)n;
}

/* The options part of a body (the values were checked by the callbacks: no JSON escapes needed). */
static void add_options(struct body *b)
{
	if (opt_class[0])
		add(b, ",\"class\":\"%s\"", opt_class);
	if (opt_priority >= 0)
		add(b, ",\"priority\":%d", opt_priority);
	if (opt_checkpoint[0])
		add(b, ",\"checkpoint\":\"%s\"", opt_checkpoint);
}

/* GPU indices from a list such as "0,2,3"; anything but digits and commas (a GPU UUID, a MIG
 * name) gives -1: the agent must be told the truth or nothing. */
static int add_gpus(struct body *b, const char *list)
{
	char tmp[512];
	int n = 0;
	snprintf(tmp, sizeof(tmp), "%s", list);
	for (char *save = NULL, *tok = strtok_r(tmp, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
		char *end;
		long v;
		errno = 0;
		v = strtol(tok, &end, 10);
		if (!*tok || *end || errno || v < 0 || v > INT_MAX || ++n > MAX_GPUS)
			return -1;
	}
	add(b, ",\"gpus\":[");
	n = 0;
	snprintf(tmp, sizeof(tmp), "%s", list);
	for (char *save = NULL, *tok = strtok_r(tmp, ",", &save); tok; tok = strtok_r(NULL, ",", &save))
		add(b, "%s%ld", n++ ? "," : "", strtol(tok, NULL, 10));
	add(b, "]");
	return 0;
}

/* Posts body to path; 0 on a 2xx answer (parsed into a), else -1 (NO_AGENT: none listens;
 * UNANSWERED: it did not answer in time) with the reason in a->error. */
static int ask_agent(const char *path, struct body *b, struct answer *a)
{
	char *text = NULL;
	char err[256];
	int status;

	memset(a, 0, sizeof(*a));
	if (b->overflow) {
		snprintf(a->error, sizeof(a->error), "request too long");
		return -1;
	}
	status = http_post(path, b->text, &text, err, sizeof(err));
	if (status < 0) {
		snprintf(a->error, sizeof(a->error), "%s", err);
		return status == NO_AGENT || status == UNANSWERED ? status : -1;
	}
	if (parse_answer(text, a) < 0) {
		snprintf(a->error, sizeof(a->error), "the agent's answer (HTTP %d) is not the JSON expected", status);
		free(text);
		return -1;
	}
	free(text);
	if (status < 200 || status > 299) {
		if (!a->error[0])
			snprintf(a->error, sizeof(a->error), "the agent refused (HTTP %d)", status);
		return -1;
	}
	return 0;
}

/* The task's adoption: asked again every RETRY_MS while no agent listens, for wait= seconds (an
 * agent restarting). Returns ask_agent's answer: 0, -1 (a refusal, or an answer not understood),
 * NO_AGENT or UNANSWERED (the reason in a->error, with how long it was tried). */
static int adopt_task(struct body *b, struct answer *a)
{
	long long deadline = now_ms() + (long long)arg_wait_s * 1000;
	int r;
	while ((r = ask_agent("/v1/jobs/adopt", b, a)) == NO_AGENT && now_ms() + RETRY_MS <= deadline)
		usleep(RETRY_MS * 1000);
	if (r == NO_AGENT && arg_wait_s > 0) {
		size_t n = strlen(a->error);
		snprintf(a->error + n, sizeof(a->error) - n, " (tried for %d s, plugin argument wait=)", arg_wait_s);
	}
	return r;
}

static int wanted(void)
{
	return opt_any || arg_adopt_all;
}

/* ------------------------------------------------------------------------ the hooks */

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();
	if (parse_args(ac, av) < 0)
		return -1;
	if (ctx != S_CTX_LOCAL && ctx != S_CTX_ALLOCATOR && ctx != S_CTX_REMOTE)
		return 0;
	for (struct spank_option *o = laminar_options; o->name; o++) {
		if (spank_option_register(sp, o) != ESPANK_SUCCESS) {
			slurm_error("laminar: cannot register --%s", o->name);
			return -1;
		}
	}
	return 0;
}

/* Local (srun) and allocator (sbatch, salloc): refuse what the local agent refuses, before the
 * job is queued. No agent on the submit host (no socket, or one nobody listens on): nothing to
 * ask, the node's agent decides at the task's start. An agent that is there but fails to answer
 * (hung, garbled) fails the command: it would likely fail the task too. */
int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	spank_context_t ctx = spank_context();
	struct stat st;
	struct body b = {0};
	static struct answer a; /* ~135 KiB: not on the stack; hooks never run concurrently */
	(void)sp;
	(void)ac;
	(void)av;
	if ((ctx != S_CTX_LOCAL && ctx != S_CTX_ALLOCATOR) || !wanted())
		return 0;
	if (stat(arg_socket, &st) < 0 || !S_ISSOCK(st.st_mode))
		return 0;
	add(&b, "{\"scheduler\":\"slurm\",\"uid\":%u,\"gid\":%u", (unsigned)getuid(), (unsigned)getgid());
	add_options(&b);
	add(&b, "}");
	switch (ask_agent("/v1/jobs/adopt/check", &b, &a)) {
	case 0:
		return 0;
	case NO_AGENT:
		slurm_verbose("laminar: no agent to ask here (%s): the node's agent decides", a.error);
		return 0;
	default:
		slurm_error("laminar: %s", a.error);
		return -1;
	}
}

/* Remote: in the task's process, after it dropped to the job's user, before it execs. Not
 * slurm_spank_task_init_privileged: there the task still runs as root, and the agent adopts a pid
 * only when it runs as the job's user (and sees the caller's own uid through SO_PEERCRED, so a
 * user's grant is checked against who the task really is). A refusal fails the task (the job sees
 * it in Slurm) rather than running it unprotected against the user's wish. */
int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	uint32_t job_id = 0;
	uid_t uid = 0;
	gid_t gid = 0;
	char gpus[512];
	struct body b = {0};
	static struct answer a; /* ~135 KiB: not on the stack; hooks never run concurrently */
	int r;
	(void)ac;
	(void)av;
	if (!spank_remote(sp) || !wanted())
		return 0;
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_GID, &gid) != ESPANK_SUCCESS) {
		slurm_error("laminar: cannot read the job's id, uid or gid from Slurm");
		return -1;
	}
	add(&b, "{\"scheduler\":\"slurm\",\"ref\":\"%u\",\"pid\":%ld,\"uid\":%u,\"gid\":%u", job_id,
	    (long)getpid(), (unsigned)uid, (unsigned)gid);
	add_options(&b);
	gpus[0] = '\0';
	/* What gres gave the step (slurmstepd sets these; not CUDA_VISIBLE_DEVICES, which a user
	 * commonly sets by hand and Slurm leaves alone in a job without gres) */
	if (spank_getenv(sp, "SLURM_STEP_GPUS", gpus, sizeof(gpus)) != ESPANK_SUCCESS &&
	    spank_getenv(sp, "SLURM_JOB_GPUS", gpus, sizeof(gpus)) != ESPANK_SUCCESS)
		gpus[0] = '\0';
	if (gpus[0] && add_gpus(&b, gpus) < 0) {
		slurm_error("laminar: job %u: GPU list %s: expected indices such as 0,1", job_id, gpus);
		return -1;
	}
	add(&b, "}");
	if ((r = adopt_task(&b, &a)) < 0) {
		if (r != -1 && arg_unreachable_run) {
			slurm_error("laminar: job %u: %s; the task runs without Laminar (plugin argument unreachable=run): "
				    "no Airlock protection, no checkpoint before a reclaim", job_id, a.error);
			return 0;
		}
		slurm_error("laminar: job %u: %s", job_id, a.error);
		return -1;
	}
	for (int i = 0; i < a.nenv; i++) {
		if (strncmp(a.env[i].name, "LAMINAR_", 8) != 0) /* the agent sets its own names only */
			continue;
		if (spank_setenv(sp, a.env[i].name, a.env[i].value, 1) != ESPANK_SUCCESS) {
			slurm_error("laminar: job %u: cannot set %s", job_id, a.env[i].name);
			return -1;
		}
	}
	slurm_verbose("laminar: job %u task %ld adopted (%d env)", job_id, (long)getpid(), a.nenv);
	return 0;
}
