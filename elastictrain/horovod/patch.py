"""Patch Horovod 0.28.1's source before the build (``scripts/setup.sh`` runs it): ``python
elastictrain/horovod/patch.py SRC``.

**A failed Gloo rendezvous fails ``hvd.init`` instead of killing the process.** In elastic mode every reset calls
``hvd.init``, whose background thread builds the new ring's Gloo contexts. When a peer of the new ring dies after
the driver assigned it and before the ring formed, the others wait for its address until the Gloo timeout, and the
``gloo::IoException`` escapes the background thread: ``std::terminate``, exit 134, for every survivor (then
horovodrun sees every worker failed and stops the job). Only Gloo's I/O errors (a timeout, a peer gone) take the
new path: a worker the driver removed from the job (``has been removed from elastic job``) still ends as before,
since Horovod starts a new worker when its host comes back. The chaos campaign (``python -m chaos campaign``) hits
this with a SIGKILL during a reset's rendezvous. Horovod already has the path for a failed initialisation
(``initialization_failed``: ``hvd.init`` raises ``ValueError``); the patch routes the Gloo set-up into it, leaves
the Gloo context ready for the next try (``Finalize``), and clears the flag when ``hvd.init`` starts again, so a
worker can try the next ring (``elastictrain.engine.collective.reset_horovod`` does).

**A rendezvous can be aborted.** When a worker of the current round exits, horovodrun's driver
(``elastictrain.horovod.hvdrun``) writes a marker under :data:`ABORT_PATH` in its rendezvous store (the HTTP
key-value store that every worker's Gloo set-up polls); a worker whose own Gloo set-up fails (its connect or
barrier: a timeout, a peer gone) writes it too, since the others of its round would wait for it in vain. The store
clears it when the next round starts. Two waits of the Gloo set-up end with a Gloo I/O error (so ``hvd.init`` fails
at once, as above, and the worker asks for the next ring) when they see it, instead of running out their time:

* ``HTTPStore::wait``, for a peer's address that a dead worker never writes (the Gloo timeout), looks every tenth
  poll (100 ms);
* a TCP pair that waits for its peer to connect (the listening side of a pair whose peer wrote its address and
  died; Gloo gives this wait five times the Gloo timeout) waits in 100-ms slices and asks the store between them
  (``connectAbortCheck``, set by Horovod's ``Rendezvous`` for its own thread only).

The marker's text (``ABORT_PATH`` here) must equal ``elastictrain.horovod.hvdrun``'s ``ABORT_SCOPE/ABORT_KEY``
(a unit test checks it; this script runs before the project is installed, so it cannot import it).

**An enqueue that races the background thread's shutdown is refused, not stranded.** ``EnqueueTensorAllreduces``
(and the other enqueues) check ``horovod_global.shut_down`` without the tensor queue's lock; the background thread,
once it leaves its loop, sets that flag and then empties the queue (``FinalizeTensorQueue``). An enqueue that read
the flag before it was set and took the lock after the queue was emptied added an entry that nothing finishes, to
the global process set's queue, which ``hvd.shutdown`` and ``hvd.init`` keep (``ProcessSetTable::Finalize_``). In
an elastic job that is a gradient hook of a survivor whose peer left mid-step (a drain's exit runs ``hvd.shutdown``):
after the reset, that parameter's hook raised "same name as another tensor that is currently being processed", and
a step whose last enqueue was the stranded one would wait for it forever. The patch closes the queue when it is
finalized (an enqueue then fails with Horovod's shut-down error, ``HorovodInternalError`` in Python, under the same
lock) and opens it again when ``hvd.init`` starts the next background thread.
``tests/integration/test_allreduce_shutdown_race.py`` checks it.

**A message that a Gloo pair cannot place fails that pair, not the process.** When workers die in the middle of a
collective, a survivor may receive a message from another survivor that is a step ahead or behind: no buffer is
posted for its slot, or the one posted is smaller (``op.preamble.length <= op.nbytes. 776 vs 8``). Gloo's TCP pair
checks this with ``GLOO_ENFORCE`` on the device thread, where nothing catches it: ``std::terminate``, exit 134, one
more worker lost to a fault that hit others (horovod/horovod#3264; the chaos campaign's collateral aborts). The
patch catches it around the pair's reads on the device thread and fails the pair with an I/O error ("Gloo protocol
error"), as a closed connection does: its pending collectives fail (``HorovodInternalError``), and the worker
goes through a reset like any survivor. ``tests/integration/test_gloo_protocol_error.py`` checks it.
The same holds for a message whose receive buffer is gone (its operation ended without it): Gloo waited for the
buffer to come back, which it never does, so the pair stopped reading for good, the end of stream behind that message
included, and a survivor waiting on that connection saw nothing until the Gloo timeout (the 60-s recoveries of the
rank-0-and-another kill test under load).

**A failed Gloo pair fails every operation that waits on it.** ``Pair::signalException`` tells the buffers of
posted recvs and sends and of bound-buffer sends, but not an unbound buffer whose send is queued on the socket
(``tx_``) or whose incoming message's header was read (``rx_``: it left the pending-recv list then, as in the
protocol errors above): their ``waitSend``/``waitRecv`` ran out the Gloo timeout although the connection was gone
(a survivor whose ring's connections were all closed still waited 60 s). The patch tells those too.

Each edit is an exact text replacement; a source that does not match exits 1 with the file and the edit named
(another Horovod version needs the patch checked again). Applying it twice is a no-op.

**The build says it is patched.** After the edits the patch writes :data:`MARKER_FILE` into Horovod's package,
naming :func:`digest`, a hash of every edit: ``elastictrain launch`` and every worker refuse a Horovod without the
marker of this patch (``elastictrain/horovod/build_check.py``, whose ``PATCH_DIGEST`` must equal ``--digest``'s output;
a unit test checks it), and ``scripts/setup.sh`` names its cached wheel by the digest, so a changed patch is built
again, never taken from the cache. ``python elastictrain/horovod/patch.py --digest`` prints it.

Size: every C++ text patch with its anchor checks; it runs before the project is installed, so it stands alone.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

MARK = "elastictrain: a failed Gloo rendezvous"

ABORT_SCOPE = "elastictrain_abort"
ABORT_KEY = "ring"
ABORT_PATH = f"{ABORT_SCOPE}/{ABORT_KEY}"
"""Where in the driver's rendezvous store (``scope/key``) an abort marker stands; its value says why."""

GLOO_INIT = """#if HAVE_GLOO
#if HAVE_MPI
  if (global_mpi_context.IsEnabled()) {"""
GLOO_INIT_PATCHED = f"""#if HAVE_GLOO
  // {MARK} fails hvd.init (initialization_failed) instead of std::terminate.
  try {{
#if HAVE_MPI
  if (global_mpi_context.IsEnabled()) {{"""

GLOO_END = """    state.process_set_table.Initialize(global_gloo_context);
  }
#endif // HAVE_GLOO

  assert(state.global_controller->IsInitialized());"""
GLOO_END_PATCHED = """    state.process_set_table.Initialize(global_gloo_context);
  }
  } catch (const ::gloo::IoException& ex) {
    LOG(ERROR) << "Horovod could not be initialized: " << ex.what();
    global_gloo_context.Finalize();
    state.initialization_failed = true;
    return;
  }
#endif // HAVE_GLOO

  assert(state.global_controller->IsInitialized());"""

GLOO_INCLUDE = """#include "gloo/gloo_controller.h"
#include "ops/gloo_operations.h"
"""
GLOO_INCLUDE_PATCHED = """#include "gloo/gloo_controller.h"
#include "ops/gloo_operations.h"
#include "gloo/common/error.h"
"""

RESET_FLAG = """    // Reset initialization flag
    horovod_global.initialization_done = false;
"""
RESET_FLAG_PATCHED = """    // Reset initialization flag
    horovod_global.initialization_done = false;
    horovod_global.initialization_failed = false;
"""

STORE_DEFINE = """#define HTTP_NOT_FOUND 404
"""
STORE_DEFINE_PATCHED = f"""#define HTTP_NOT_FOUND 404
// elastictrain: the driver aborts a rendezvous by writing this key (scope/key) in its store.
#define ELASTICTRAIN_ABORT_PATH "{ABORT_PATH}"
"""

STORE_URL = """    url_prefix_ +=
        "http://" + server_ip + ":" + std::to_string(port) + "/" + scope + "/";
  }
"""
STORE_URL_PATCHED = """    url_prefix_ +=
        "http://" + server_ip + ":" + std::to_string(port) + "/" + scope + "/";
    abort_url_ = "http://" + server_ip + ":" + std::to_string(port) + "/" ELASTICTRAIN_ABORT_PATH;
  }
"""

STORE_DECLARE = """  bool CheckKeys(const std::vector<std::string>& keys);
"""
STORE_DECLARE_PATCHED = """  bool CheckKeys(const std::vector<std::string>& keys);

  // elastictrain: whether the rendezvous was aborted (reason, when given: the marker's text).
  bool Aborted(std::string* reason);

  // elastictrain: abort the rendezvous for every worker of the round (this one gave up).
  void Abort(const std::string& reason);
"""

STORE_MEMBER = """  std::string url_prefix_;
  int rank_;
"""
STORE_MEMBER_PATCHED = """  std::string url_prefix_;
  std::string abort_url_;
  int rank_;
"""

STORE_ABORTED = """void HTTPStore::Finalize() { HTTP_DELETE(std::to_string(rank_)); }
"""
STORE_ABORTED_PATCHED = """void HTTPStore::Finalize() { HTTP_DELETE(std::to_string(rank_)); }

bool HTTPStore::Aborted(std::string* reason) {
  http::Request request(abort_url_);
  http::Response response = PerformHTTP(request, HTTP_GET_METHOD, "");
  if (response.status != HTTP_OK) {
    return false;
  }
  if (reason != nullptr) {
    reason->assign(response.body.begin(), response.body.end());
  }
  return true;
}

void HTTPStore::Abort(const std::string& reason) {
  http::Request request(abort_url_);
  PerformHTTP(request, HTTP_PUT_METHOD, reason);
}
"""

STORE_WAIT = """  while (!CheckKeys(keys)) {
    const auto elapsed"""
STORE_WAIT_PATCHED = """\
  // elastictrain: every tenth poll (100 ms) also asks whether the driver aborted the rendezvous.
  for (int polls = 0; !CheckKeys(keys); ++polls) {
    std::string reason;
    if (polls % 10 == 0 && Aborted(&reason)) {
      GLOO_THROW_IO_EXCEPTION(GLOO_ERROR_MSG("Rendezvous aborted by the driver (", reason,
                                             ") while waiting for key(s): ", ::gloo::MakeString(keys)));
    }
    const auto elapsed"""

CONTEXT_INCLUDE = """#include "gloo/transport/tcp/device.h"
"""
CONTEXT_INCLUDE_PATCHED = """#include "gloo/transport/tcp/device.h"
#include "gloo/transport/tcp/pair.h"
"""

CONTEXT_CONNECT = """  context->setTimeout(timeout);
  context->connectFullMesh(*store, dev);
"""
CONTEXT_CONNECT_PATCHED = """  context->setTimeout(timeout);
  // elastictrain: while this thread connects the pairs, a pair that waits for its peer gives up when the rendezvous
  // is aborted (gloo::transport::tcp::connectAbortCheck); a set-up that fails here (connect or barrier) aborts the
  // rendezvous for the others of the round, which would otherwise wait for this worker until their timeout.
  struct AbortCheck {
    HTTPStore* http;
    std::string who;
    int unwinding = std::uncaught_exceptions();
    AbortCheck(GlooStore* s, std::string w) : http(dynamic_cast<HTTPStore*>(s)), who(std::move(w)) {
#ifdef __linux__
      if (http != nullptr) {
        auto* store = http;
        gloo::transport::tcp::connectAbortCheck() = [store]() {
          try {
            return store->Aborted(nullptr);
          } catch (const std::exception&) {
            return false;
          }
        };
      }
#endif
    }
    ~AbortCheck() {
#ifdef __linux__
      gloo::transport::tcp::connectAbortCheck() = nullptr;
#endif
      if (http != nullptr && std::uncaught_exceptions() > unwinding) {
        try {
          http->Abort(who + " gave up its rendezvous");
        } catch (const std::exception&) {
        }
      }
    }
  } abort_check(store.get(), prefix + " rank " + std::to_string(rank));
  context->connectFullMesh(*store, dev);
"""

PAIR_HOOK = """constexpr auto kLargeTimeDuration = std::chrono::hours(100);
"""
PAIR_HOOK_PATCHED = """constexpr auto kLargeTimeDuration = std::chrono::hours(100);

// elastictrain: asked every 100 ms while a pair of this thread waits for its initial connect; true ends the wait
// with an IoException instead of the connect timeout. Set by whoever connects the pairs (Horovod's Rendezvous).
inline std::function<bool()>& connectAbortCheck() {
  static thread_local std::function<bool()> check;
  return check;
}
"""

PAIR_WAIT = """      auto done = cv_.wait_for(lock, relTime, pred);
      if (!done) {
        signalAndThrowException(GLOO_ERROR_MSG("Connect timeout ", peer_.str()));"""
PAIR_WAIT_PATCHED = """\
      // elastictrain: in 100-ms slices, asking connectAbortCheck() between them (without the pair's lock).
      const auto deadline = std::chrono::steady_clock::now() + relTime;
      auto done = false;
      while (!done && std::chrono::steady_clock::now() < deadline) {
        const auto slice = std::min<std::chrono::steady_clock::duration>(
            deadline - std::chrono::steady_clock::now(), std::chrono::milliseconds(100));
        done = cv_.wait_for(lock, slice, pred);
        if (!done && connectAbortCheck()) {
          lock.unlock();
          const auto aborted = connectAbortCheck()();
          lock.lock();
          if (aborted && !pred()) {
            signalAndThrowException(GLOO_ERROR_MSG("Connect aborted: the driver aborted the rendezvous ", peer_.str()));
          }
        }
      }
      if (!done) {
        signalAndThrowException(GLOO_ERROR_MSG("Connect timeout ", peer_.str()));"""

PAIR_READ = """  if (events & EPOLLIN) {
    while (read()) {
      // Keep going
    }
  }
}
"""
PAIR_READ_PATCHED = """  if (events & EPOLLIN) {
    // elastictrain: a message this pair cannot place (a peer out of step after a failure) fails the pair's
    // collectives with an I/O error instead of std::terminate on the device thread.
    try {
      while (read()) {
        // Keep going
      }
    } catch (const ::gloo::EnforceNotMet& e) {
      if (ex_ == nullptr) {
        signalException(GLOO_ERROR_MSG("Gloo protocol error ", peer_.str(), ": ", e.what()));
      }
    } catch (const ::gloo::IoException&) {
      // A write that a read triggered (a send answering the peer's notification) failed: the pair already holds
      // the error and told its operations (signalException), so nothing is left to do on the device thread.
      if (ex_ == nullptr) {
        throw;
      }
    }
  }
}
"""

PAIR_GONE = """    buf = NonOwningPtr<UnboundBuffer>(op.ubuf);
    if (!buf) {
      return -1;
    }
"""
PAIR_GONE_PATCHED = """    buf = NonOwningPtr<UnboundBuffer>(op.ubuf);
    // elastictrain: the buffer this message was posted for is gone (its operation ended without it). Waiting for it
    // (-1) would stop this pair reading for good, its end of stream included: fail the pair instead.
    GLOO_ENFORCE(buf, "the receive buffer of slot ", op.preamble.slot, " is gone");
"""

PAIR_SIGNAL = """  // Loop through posted send operations.
  for (auto& op : tx_) {
    if (op.buf != nullptr) {
      op.buf->signalException(ex);
    }
  }
"""
PAIR_SIGNAL_PATCHED = """  // Loop through posted send operations.
  for (auto& op : tx_) {
    if (op.buf != nullptr) {
      op.buf->signalException(ex);
    }
    // elastictrain: and the unbound buffers of posted sends, which would otherwise wait out the Gloo timeout.
    NonOwningPtr<UnboundBuffer> ubuf(op.ubuf);
    if (ubuf) {
      ubuf->signalException(ex);
    }
  }

  // elastictrain: the unbound buffer of the message being read (it left localPendingRecv_ when its header came).
  {
    NonOwningPtr<UnboundBuffer> ubuf(rx_.ubuf);
    if (ubuf) {
      ubuf->signalException(ex);
    }
  }
"""

QUEUE_MARK = "elastictrain: a finalized tensor queue"

QUEUE_DECLARE = """  void FinalizeTensorQueue(const Status& status);
"""
QUEUE_DECLARE_PATCHED = f"""  void FinalizeTensorQueue(const Status& status);

  // {QUEUE_MARK} refuses entries (SHUT_DOWN_ERROR) until hvd.init reopens it.
  void ReopenTensorQueue();
"""

QUEUE_MEMBER = """  mutable std::mutex mutex_;
};"""
QUEUE_MEMBER_PATCHED = """  mutable std::mutex mutex_;

  // Set by FinalizeTensorQueue, cleared by ReopenTensorQueue (both under mutex_).
  bool closed_ = false;
};"""

QUEUE_ADD = """Status TensorQueue::AddToTensorQueue(TensorTableEntry& e, Request& message) {
  std::lock_guard<std::mutex> guard(mutex_);
"""
QUEUE_ADD_PATCHED = f"""Status TensorQueue::AddToTensorQueue(TensorTableEntry& e, Request& message) {{
  std::lock_guard<std::mutex> guard(mutex_);
  // {QUEUE_MARK}: the caller checked shut_down without this lock.
  if (closed_) {{
    return SHUT_DOWN_ERROR;
  }}
"""

QUEUE_ADD_MULTI = """                                          std::vector<Request>& messages) {
  std::lock_guard<std::mutex> guard(mutex_);
"""
QUEUE_ADD_MULTI_PATCHED = f"""                                          std::vector<Request>& messages) {{
  std::lock_guard<std::mutex> guard(mutex_);
  // {QUEUE_MARK}: the caller checked shut_down without this lock.
  if (closed_) {{
    return SHUT_DOWN_ERROR;
  }}
"""

QUEUE_FINALIZE = """void TensorQueue::FinalizeTensorQueue(const Status& status) {
  std::lock_guard<std::mutex> guard(mutex_);
"""
QUEUE_FINALIZE_PATCHED = """void TensorQueue::FinalizeTensorQueue(const Status& status) {
  std::lock_guard<std::mutex> guard(mutex_);
  closed_ = true;
"""

QUEUE_REOPEN = """// Parse tensor names from response and generate a vector of"""
QUEUE_REOPEN_PATCHED = """void TensorQueue::ReopenTensorQueue() {
  std::lock_guard<std::mutex> guard(mutex_);
  closed_ = false;
}

// Parse tensor names from response and generate a vector of"""

QUEUE_INIT = """    horovod_global.background_thread =
        std::thread(BackgroundThreadLoop, std::ref(horovod_global));
"""
QUEUE_INIT_PATCHED = f"""    // {QUEUE_MARK}: process set 0's queue, closed by the last shutdown, opens again.
    horovod_global.process_set_table.Get(0).tensor_queue.ReopenTensorQueue();
    horovod_global.background_thread =
        std::thread(BackgroundThreadLoop, std::ref(horovod_global));
"""


EDITS = (
    ("horovod/common/operations.cc", GLOO_INCLUDE, GLOO_INCLUDE_PATCHED),
    ("horovod/common/operations.cc", GLOO_INIT, GLOO_INIT_PATCHED),
    ("horovod/common/operations.cc", GLOO_END, GLOO_END_PATCHED),
    ("horovod/common/operations.cc", RESET_FLAG, RESET_FLAG_PATCHED),
    ("horovod/common/gloo/http_store.h", STORE_DEFINE, STORE_DEFINE_PATCHED),
    ("horovod/common/gloo/http_store.h", STORE_URL, STORE_URL_PATCHED),
    ("horovod/common/gloo/http_store.h", STORE_DECLARE, STORE_DECLARE_PATCHED),
    ("horovod/common/gloo/http_store.h", STORE_MEMBER, STORE_MEMBER_PATCHED),
    ("horovod/common/gloo/http_store.cc", STORE_ABORTED, STORE_ABORTED_PATCHED),
    ("horovod/common/gloo/http_store.cc", STORE_WAIT, STORE_WAIT_PATCHED),
    ("horovod/common/gloo/gloo_context.cc", CONTEXT_INCLUDE, CONTEXT_INCLUDE_PATCHED),
    ("horovod/common/gloo/gloo_context.cc", CONTEXT_CONNECT, CONTEXT_CONNECT_PATCHED),
    ("third_party/gloo/gloo/transport/tcp/pair.h", PAIR_HOOK, PAIR_HOOK_PATCHED),
    ("third_party/gloo/gloo/transport/tcp/pair.h", PAIR_WAIT, PAIR_WAIT_PATCHED),
    ("third_party/gloo/gloo/transport/tcp/pair.cc", PAIR_READ, PAIR_READ_PATCHED),
    ("third_party/gloo/gloo/transport/tcp/pair.cc", PAIR_GONE, PAIR_GONE_PATCHED),
    ("third_party/gloo/gloo/transport/tcp/pair.cc", PAIR_SIGNAL, PAIR_SIGNAL_PATCHED),
    ("horovod/common/tensor_queue.h", QUEUE_DECLARE, QUEUE_DECLARE_PATCHED),
    ("horovod/common/tensor_queue.h", QUEUE_MEMBER, QUEUE_MEMBER_PATCHED),
    ("horovod/common/tensor_queue.cc", QUEUE_ADD, QUEUE_ADD_PATCHED),
    ("horovod/common/tensor_queue.cc", QUEUE_ADD_MULTI, QUEUE_ADD_MULTI_PATCHED),
    ("horovod/common/tensor_queue.cc", QUEUE_FINALIZE, QUEUE_FINALIZE_PATCHED),
    ("horovod/common/tensor_queue.cc", QUEUE_REOPEN, QUEUE_REOPEN_PATCHED),
    ("horovod/common/operations.cc", QUEUE_INIT, QUEUE_INIT_PATCHED),
)


def patch(src: Path) -> list[str]:
    """Apply :data:`EDITS` under ``src``; returns what was done. Raises ``ValueError`` when a file does not match."""
    done = []
    texts: dict[str, str] = {}
    for rel, old, new in EDITS:
        text = texts.get(rel)
        if text is None:
            text = (src / rel).read_text()
        if new in text:
            done.append(f"{rel}: already patched")
        elif text.count(old) == 1:
            text = text.replace(old, new)
            done.append(f"{rel}: patched")
        else:
            raise ValueError(f"{rel}: the text to patch was found {text.count(old)} times, not once: {old[:60]!r}")
        texts[rel] = text
    for rel, text in texts.items():
        (src / rel).write_text(text)
    return done


MARKER_FILE = "horovod/elastictrain_patch.py"
"""The module the patch adds to Horovod's package (so the wheel carries it): :func:`marker_text`."""


def digest() -> str:
    """The patch's identity: 16 hex digits of a SHA-256 over every edit (file, text replaced, replacement)."""
    h = hashlib.sha256()
    for edit in EDITS:
        for part in edit:
            h.update(part.encode())
            h.update(b"\0")
    return h.hexdigest()[:16]


def marker_text() -> str:
    return (
        '"""Written by elastictrain\'s elastictrain/horovod/patch.py into the Horovod source it patched: '
        "this build carries\n"
        'the patch named below (elastictrain/horovod/build_check.py checks it)."""\n\n'
        f'PATCH_DIGEST = "{digest()}"\n'
    )


def write_marker(src: Path) -> str:
    """Write :data:`MARKER_FILE` under ``src``; returns what was done."""
    (src / MARKER_FILE).write_text(marker_text())
    return f"{MARKER_FILE}: written (patch {digest()})"


def main(argv: list[str]) -> int:
    if argv == ["--digest"]:
        sys.stdout.write(f"{digest()}\n")
        return 0
    if len(argv) != 1:
        sys.stderr.write("usage: python elastictrain/horovod/patch.py HOROVOD_SOURCE_DIR | --digest\n")
        return 2
    try:
        for line in [*patch(Path(argv[0])), write_marker(Path(argv[0]))]:
            sys.stdout.write(f"patch_horovod: {line}\n")
    except (OSError, ValueError) as e:
        sys.stderr.write(f"patch_horovod: error: {e}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
