"""Training sets read as streams, for corpora too large to index (jsonl, text, parquet or tar shards): a task's
builder returns a StreamedDataset, and StreamLoader reads it on every rank and loader worker without overlap, ends
an epoch at the same step on every rank, and saves where the epoch stands, so that a resume continues at the exact
sample, on the same or another number of ranks.

The corpus is cut into pieces known without reading them: byte ranges of jsonl and text files (a line belongs
to the piece it starts in), row groups of parquet files, whole tar shards (WebDataset's layout). An epoch deals
its pieces, in an order drawn from --seed and the epoch, to streams, one per (rank, loader worker); a stream
reads its pieces in turn, and each sample it yields is named (piece, index within the piece). The training
process counts what it has consumed, not what the workers have read ahead, so a checkpoint holds exactly the
samples of the steps taken: for every stream, the pieces it has left and how far into the first of them it
stands. A resume on the same number of ranks and workers gives every stream its own rest (bitwise the
uninterrupted run); on another number, the rests are dealt anew (partly read pieces first), so no sample is
trained on twice or skipped. A resume reads again only the start of each partly read piece, up to where it stood.
Random augmentation in `read` draws from the CPU generator seeded for each sample by (--seed, epoch, piece,
index), so it is redrawn identically on resume too.

Why not torchdata's StatefulDataLoader or a Hugging Face streaming dataset: they save each rank's state, which a
job resumed on another world size cannot use (pytorch/torchtitan#291); here the position is the job's.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import itertools
import json
import logging
import math
import os
import tarfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .distributed import DistEnv, side_group
from .errors import UsageError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StreamedDataset:
    """What a task's builder returns for a streamed training set: `pieces`, picklable descriptions of the corpus's
    parts (file_pieces makes them for files), each naming its content well enough that another content gives
    another description (a checkpoint's position is only taken for the same pieces), and `read(piece)`, which
    yields that piece's samples in the same order every time it is called. `read` runs in loader workers: a
    module-level function (or a functools.partial of one) that keeps no state between calls."""

    pieces: list
    read: Callable[[Any], Iterable[Any]]


# ---- pieces of files ---------------------------------------------------------------------------------------

SUFFIXES = (".jsonl", ".txt", ".parquet", ".tar")


def expand_files(pattern: str, flag: str, suffixes: tuple[str, ...] = SUFFIXES) -> list[str]:
    """The files a glob names, sorted (the same list on every rank), or one line saying what is wrong."""
    paths = sorted(path for path in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(path))
    if not paths:
        raise UsageError(f"{flag} {pattern!r} matches no file; give a glob such as 'corpus/*{suffixes[0]}' (quoted, "
                         "so the shell leaves it to train.py)")
    odd = [path for path in paths if not path.endswith(suffixes)]
    if odd:
        raise UsageError(f"{flag} {pattern!r} matches {odd[0]}, which is not {', '.join(suffixes)}; narrow the glob")
    return paths


def file_pieces(paths: list[str], piece_bytes: int) -> list[tuple[str, int, int]]:
    """(path, start, end) byte ranges of about `piece_bytes` for jsonl and text files; (path, row group, its rows)
    for parquet; (path, 0, size), the whole file, for a tar shard. Known from file sizes and parquet footers
    alone, so every rank lists the same pieces at once; a file rewritten to another size or row count gives
    other pieces."""
    pieces = []
    for path in paths:
        size = nonempty_size(path)
        if path.endswith(".parquet"):
            metadata = parquet_file(path).metadata
            pieces += [(path, group, metadata.row_group(group).num_rows) for group in range(metadata.num_row_groups)]
        elif path.endswith(".tar"):
            pieces.append((path, 0, size))
        else:
            pieces += [(path, start, min(start + piece_bytes, size)) for start in range(0, size, piece_bytes)]
    return pieces


def nonempty_size(path: str) -> int:
    size = os.path.getsize(path)
    if size == 0:
        raise UsageError(f"{path} is empty; remove it from the corpus")
    return size


def require_max_steps(options) -> None:
    """A streamed training set's epoch has no length before it is read: the lr schedule spans --max-steps. A
    task checks it before any process group starts; build_loaders again, for any builder that returns a stream."""
    if options.max_steps is None:
        raise UsageError(f"--data {options.task.data} has no length known before it is read, so the lr schedule "
                         "cannot span --epochs; give --max-steps, the steps it spans")


def check_first_records(paths: list[str], field: str = "text") -> None:
    """Before any process group starts: each file's first record has `field` (a parquet file: its schema), so
    that a wrong corpus is one line here rather than an error inside a loader worker."""
    for path in paths:
        nonempty_size(path)
        if path.endswith(".parquet"):
            names = parquet_file(path).schema_arrow.names
            if field not in names:
                raise UsageError(f"{path} has no {field!r} column (it has {', '.join(names)})")
        elif path.endswith(".tar"):
            key, fields = next(tar_samples(path), (None, {}))
            if field not in fields:
                raise UsageError(f"{path}: its first sample ({key}) has no .{field} file (it has "
                                 f"{', '.join(sorted(fields)) or 'none'}); a shard holds <key>.{field} beside the "
                                 "sample's other files")
        else:
            next(read_documents((path, 0, 1), field), None)


def tar_samples(path: str) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) for each sample of a tar shard in WebDataset's layout: the files of a sample are
    next to each other and share the key, their path up to the first dot of the file name (a/0007.jpg and
    a/0007.cls are sample a/0007's "jpg" and "cls")."""
    key, fields = None, {}
    with tarfile.open(path) as tar:
        for member in tar:
            if not member.isfile():
                continue
            folder, _, name = member.name.rpartition("/")
            stem, _, extension = name.partition(".")
            if f"{folder}/{stem}" != key:
                if fields:
                    yield key, fields
                key, fields = f"{folder}/{stem}", {}
            fields[extension] = tar.extractfile(member).read()
    if fields:
        yield key, fields


def parquet_file(path: str):
    try:
        import pyarrow.parquet
    except ImportError:
        raise UsageError(f"{path} is parquet, which needs pyarrow: pip install -e '.[streaming]'") from None
    return pyarrow.parquet.ParquetFile(path)


def read_documents(piece: tuple[str, int, int], field: str = "text") -> Iterator[tuple[str, bool]]:
    """(text, whether a document ends with it) for each record of a piece: the `field` of each jsonl line or
    parquet row, a whole document each; a .txt file is one document, read line by line (newlines kept), which
    its last piece ends with ("", True)."""
    path, start, end = piece
    if path.endswith(".parquet"):
        table = parquet_file(path).read_row_group(start)
        if field not in table.column_names:
            raise UsageError(f"{path} has no {field!r} column (it has {', '.join(table.column_names)})")
        yield from ((text, True) for text in table.column(field).to_pylist())
        return
    with open(path, "rb") as file:
        file.seek(start)
        if start > 0:
            file.seek(start - 1)
            file.readline()  # the rest of a line that began in the previous piece belongs to it
        while file.tell() < end:
            line = file.readline()
            if not line:
                break
            if path.endswith(".txt"):
                yield line.decode("utf-8", errors="replace"), False
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise UsageError(f"{path}: a line at byte {file.tell() - len(line)} is not JSON ({error.msg}); "
                                 "each line of a .jsonl file must be one JSON object") from None
            if not isinstance(record, dict) or field not in record:
                raise UsageError(f"{path}: the line at byte {file.tell() - len(line)} has no {field!r} field; "
                                 f"each line must be an object with the document's text as {field!r}")
            yield record[field], True
        if path.endswith(".txt") and end == os.path.getsize(path):
            yield "", True  # the file's end: its document is complete


# ---- the epoch's plan: which stream reads which pieces ------------------------------------------------------

Stream = list[list[int]]  # [[piece number, first sample to read], ...]: what one stream has left this epoch


def deal(pieces: list[list[int]], streams: int) -> list[Stream]:
    """Pieces (with the sample each starts at) to `streams` streams, round robin, in the order given."""
    return [[list(piece) for piece in pieces[stream::streams]] for stream in range(streams)]


def first_plan(piece_count: int, streams: int, seed: int, epoch: int) -> list[Stream]:
    order = torch.randperm(piece_count, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch)).tolist()
    return deal([[piece, 0] for piece in order], streams)


def replan(saved: list[Stream], streams: int) -> list[Stream]:
    """The rest of an epoch saved with another number of streams, dealt to `streams`: partly read pieces first
    (so a resize starts no more pieces than it must), then the others, alternating between the old streams as
    the first deal did."""
    started = [stream[0] for stream in saved if stream and stream[0][1] > 0]
    unstarted = [stream[1:] if stream and stream[0][1] > 0 else stream for stream in saved]
    rest = [piece for column in itertools.zip_longest(*unstarted) for piece in column if piece is not None]
    return deal(started + rest, streams)


def named_batch(samples: list, collate: Callable[[list], Any]) -> tuple[list, Any]:
    """A batch, and the names of its samples. A function, not a method: under forkserver or spawn (Python 3.14's
    default on Linux, macOS's) a loader worker gets it pickled, and a loader that holds a process group is not."""
    return [name for name, _ in samples], collate([sample for _, sample in samples])


def first_line_of_ours(error: UsageError) -> str:
    """The one line of a UsageError, also when a DataLoader worker raised it: the DataLoader raises it again
    with the worker's traceback as its message, whose last line is "...UsageError: <ours>"."""
    return str(error).strip().splitlines()[-1].split("UsageError: ", 1)[-1]


class PieceReader(IterableDataset):
    """What a loader worker runs: the samples of its stream, each named (stream, piece, index), each read with
    the CPU generator seeded for that sample alone."""

    def __init__(self, dataset: StreamedDataset, streams: list[Stream], stream_numbers: list[int], seed: int,
                 epoch: int):
        self.dataset, self.streams, self.stream_numbers = dataset, streams, stream_numbers
        self.seed, self.epoch = seed, epoch

    def __iter__(self) -> Iterator[tuple[tuple[int, int, int], Any]]:
        worker = get_worker_info()
        slot = worker.id if worker is not None else 0
        for piece, start in self.streams[slot]:
            samples = self.dataset.read(self.dataset.pieces[piece])
            for index in itertools.count():
                # Within fork_rng: with --num-workers 0 this is the training process, whose generator is dropout's.
                with torch.random.fork_rng(devices=[]):
                    torch.default_generator.manual_seed(
                        (((self.seed * 1_000_003 + self.epoch) * 1_000_033 + piece) * 1_000_037 + index) % 2**63)
                    sample = next(samples, samples)
                if sample is samples:  # the piece has no more
                    break
                if index >= start:  # those before were trained on before a resume: read again, not trained on
                    yield (self.stream_numbers[slot], piece, index), sample


# ---- the loader ----------------------------------------------------------------------------------------------

class StreamLoader:
    """Batches of a StreamedDataset for this rank, one optimizer step (`grad_accum` batches) at a time, and the
    position of its epoch for checkpoints (gather_from_ranks, state_dict, load_state_dict).

    Each batch is one stream's samples in order; with W loader workers, the batches come from the rank's W
    streams in turn, as the DataLoader returns them. Streams run dry at their own time: before each step every
    rank says whether it has the step's batches (an all-reduce, min, on the job's gloo side group, issued one step
    ahead so that it never waits), and the epoch ends at the first step some rank lacks, on every rank, instead
    of leaving the others waiting in a collective. The batches some ranks had read for that step are not
    trained on in this epoch."""

    position_entry = "stream_position"  # its checkpoint entry: where the stream stands

    def __init__(self, dataset: StreamedDataset, env: DistEnv, *, batch_size: int, grad_accum: int,
                 num_workers: int, seed: int, collate: Callable[[list], Any], pin_memory: bool,
                 worker_init_fn: Callable[[int], None] | None, sample_log: Path | None):
        self.dataset, self.env = dataset, env
        self.batch_size, self.grad_accum, self.num_workers, self.seed = batch_size, grad_accum, num_workers, seed
        self.collate, self.pin_memory, self.worker_init_fn = collate, pin_memory, worker_init_fn
        self.sample_log = sample_log
        self.slots = max(num_workers, 1)  # streams per rank
        self.stream_count = env.world_size * self.slots
        self.group = side_group()  # the job's gloo group for small agreements (None: one plain process)
        self.epoch = -1
        self.plan: list[Stream] = []  # this rank's streams as they stood at the epoch's (or the resume's) start
        self.rotation = 0  # which of this rank's streams gives the next batch
        self.consumed: dict[int, tuple[int, int]] = {}  # stream -> (piece, index) of its last sample consumed
        self.saved: dict | None = None  # a position loaded from a checkpoint, for the epoch it belongs to
        self.gathered: dict | None = None  # the whole job's position, made by gather_from_ranks
        # A position names pieces by number: it means nothing for another list of pieces.
        self.corpus = hashlib.sha256(repr(dataset.pieces).encode()).hexdigest()[:16]
        self.resumed = False  # this epoch continues a saved position (which may stand at its very end)

    def samples_in_epochs(self, epochs: int) -> None:  # not known before it is read: the run spans --max-steps
        raise UsageError("a streamed training set's run is --max-steps long, not --epochs")

    steps_in_epochs = samples_in_epochs

    def samples_in_steps(self, steps: int) -> int:  # the first `steps` steps' (--max-steps): what the schedule spans
        return steps * self.samples_per_step

    def steps_to(self, samples: int, progress) -> int:  # from where `progress` stands until `samples` in all
        return max(math.ceil((samples - progress.samples_seen) / self.samples_per_step), 0)

    @property
    def samples_per_step(self) -> int:  # all ranks together
        return self.batch_size * self.grad_accum * self.env.world_size

    def samples_in_step(self, samples_in_epoch: int) -> int:
        return self.samples_per_step

    def start_epoch(self, epoch: int, samples_in_epoch: int) -> None:
        """Plan `epoch`: from the loaded position if it is this epoch's, else from its start (the position, not
        a count of samples, says where a stream stands)."""
        self.epoch, self.consumed, self.rotation = epoch, {}, 0
        saved, self.saved = (self.saved if self.saved and self.saved["epoch"] == epoch else None), None
        self.resumed = saved is not None
        if saved is None:
            every = first_plan(len(self.dataset.pieces), self.stream_count, self.seed, epoch)
        elif len(saved["rotation"]) == self.env.world_size and len(saved["streams"]) == self.stream_count:
            every = saved["streams"]  # the same ranks and workers: each stream its own rest, in the same order
            self.rotation = saved["rotation"][self.env.rank]
        else:
            every = replan(saved["streams"], self.stream_count)
            if self.env.is_main_process:
                log.info("streamed epoch %d: the rest of %d streams dealt anew to %d (%d ranks x %d)", epoch,
                         len(saved["streams"]), self.stream_count, self.env.world_size, self.slots)
        mine = range(self.env.rank * self.slots, (self.env.rank + 1) * self.slots)
        self.plan = [every[stream] for stream in mine]
        if saved is None and not all(every):  # the whole plan, the same on every rank: all of them stop alike
            raise UsageError(f"the streamed training set has {len(self.dataset.pieces)} pieces, fewer than "
                             f"{self.env.world_size} ranks x {self.slots} loader workers, so some would read "
                             "nothing; use fewer --num-workers, or split the corpus into more or smaller files")

    def __iter__(self) -> Iterator[Any]:
        # Worker w reads stream rotation + w, so that the batches come in the order the interrupted run had.
        order = [(self.rotation + slot) % self.slots for slot in range(self.slots)]
        first = self.env.rank * self.slots
        reader = PieceReader(self.dataset, [self.plan[slot] for slot in order], [first + slot for slot in order],
                             self.seed, self.epoch)
        # The next step's batches are read before this step's are handed over: enough read-ahead for all of them.
        read_ahead = dict(prefetch_factor=max(2, math.ceil((self.grad_accum + 1) / self.num_workers)),
                          worker_init_fn=self.worker_init_fn) if self.num_workers else {}
        loader = DataLoader(reader, batch_size=self.batch_size, num_workers=self.num_workers, drop_last=True,
                            collate_fn=functools.partial(named_batch, collate=self.collate),
                            pin_memory=self.pin_memory, generator=torch.Generator().manual_seed(self.seed),
                            **read_ahead)  # a generator of its own: leaves the global RNG be
        batches = iter(loader)
        upcoming, agreement = self.agree_on_next_step(batches)
        if not self.resumed and not self.wait(agreement):
            raise UsageError(f"the streamed training set gives some rank no full step of {self.grad_accum} x "
                             f"{self.batch_size} samples this epoch; lower --batch-size or --grad-accum, or use "
                             "more data")
        try:
            while self.wait(agreement):
                step, (upcoming, agreement) = upcoming, self.agree_on_next_step(batches)
                for names, batch in step:
                    self.count(names)
                    yield batch
        finally:
            self.wait(agreement)  # issued on every rank: completed, so that the group is clear for the next

    def agree_on_next_step(self, batches: Iterator) -> tuple[list, tuple]:
        try:
            step = list(itertools.islice(batches, self.grad_accum))
        except UsageError as error:  # bad input found in this rank's pieces alone
            raise UsageError(first_line_of_ours(error), same_on_every_rank=False) from None
        flag = torch.tensor([int(len(step) == self.grad_accum)], dtype=torch.int32)
        work = (dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group, async_op=True)
                if self.group is not None else None)
        return step, (flag, work)

    @staticmethod
    def wait(agreement: tuple) -> bool:
        flag, work = agreement
        if work is not None:
            work.wait()
        return bool(flag.item())

    def count(self, names: list[tuple[int, int, int]]) -> None:
        stream, piece, index = names[-1]  # a batch is one stream's samples, in order
        self.consumed[stream] = (piece, index)
        self.rotation = (stream - self.env.rank * self.slots + 1) % self.slots
        if self.sample_log is not None:  # what is trained on, not what the workers read ahead
            with open(self.sample_log, "a") as log_file:
                log_file.write("".join(f"{self.epoch}:{piece}:{index}\n" for _, piece, index in names))

    def rest(self) -> list[Stream]:
        """This rank's streams from their next sample on: the pieces before the one last consumed are done."""
        streams = []
        for slot, stream in enumerate(self.plan):
            last = self.consumed.get(self.env.rank * self.slots + slot)
            if last is None:
                streams.append(stream)
                continue
            at = next(position for position, (piece, _) in enumerate(stream) if piece == last[0])
            streams.append([[last[0], last[1] + 1], *stream[at + 1:]])
        return streams

    # ---- checkpointing: a component of build_checkpointer ---------------------------------------------------

    def gather_from_ranks(self) -> None:
        """Before a save, on every rank (a collective): the position of every stream of the job."""
        mine = {"streams": self.rest(), "rotation": self.rotation}
        every = [mine]
        if self.group is not None:
            every = [None] * self.env.world_size
            dist.all_gather_object(every, mine, group=self.group)
        self.gathered = {"epoch": self.epoch, "streams": [stream for rank in every for stream in rank["streams"]],
                         "rotation": [rank["rotation"] for rank in every],
                         "corpus": (self.corpus, len(self.dataset.pieces))}

    def state_dict(self) -> dict:
        # A string: the same in a .pt file (it loads with weights_only) and in a DCP folder, at any world size.
        return {"position": json.dumps(self.gathered)}

    def load_state_dict(self, state: dict) -> None:
        saved = json.loads(state["position"])
        if saved is not None and tuple(saved["corpus"]) != (self.corpus, len(self.dataset.pieces)):
            raise UsageError(f"the streamed training set is not the one this checkpoint was reading ("
                             f"{saved['corpus'][1]} pieces then, {len(self.dataset.pieces)} now, or other files): "
                             "its position would name other samples. Resume with the same files and --piece-mb, "
                             "or start a new run with another --ckpt-dir")
        self.saved = saved
