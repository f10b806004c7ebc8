"""An evaluation's HTML report: one file that opens from disk (no network), written beside the JSON
figures of decode.py, score.py, the vocoder's evaluate.py and the SSL protocol's table.

    report.html             the page: headline figures and the command that made them, training
                            curves, one row per utterance (sortable by any column, paginated)
    report_files/           what the rows point at: audio (<audio preload="none">: nothing is read
                            until played), images, the curves' PNG

The rows are an embedded JSON array rendered by the page's own script a page at a time (PAGE_SIZE
rows), so a test set of thousands of utterances opens as fast as one of ten; audio and images stay
files beside the page rather than base64 inside it (a LibriSpeech test split is ~350 MB of FLAC): a
tool links them there (a hard link, or a copy across file systems), so the folder can be moved or
zipped whole. The page is written atomically (a temporary name, then a rename), like the JSON.

A column is (key, label, kind); kinds: "text", "num" (a float, 3 decimals), "pct" (a rate shown as
%), "audio", "image" and "link" (a path relative to the page), "edits" (`edit_segments`: a reference against
a hypothesis, substitutions, deletions and insertions marked).
"""

from __future__ import annotations

import html
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

PAGE_SIZE = 50  # rows rendered at a time: a page of 50 audio players and images stays light


def command_line(argv: list[str] | None = None) -> str:
    """The command that made a report, shell-quoted as one would type it again (`python script.py ...`)."""
    argv = list(sys.argv if argv is None else argv)
    if argv and argv[0].endswith(".py"):
        argv = ["python", *argv]
    return shlex.join(argv)


def edit_segments(ref: str, hyp: str, unit: str = "words") -> list[list[str]]:
    """[[op, ref text, hyp text], ...] along jiwer's alignment of `hyp` to `ref`: op "=" (equal), "S"
    (substituted), "D" (deleted: in ref only), "I" (inserted: in hyp only). `unit`: "words" or "chars"
    (jiwer.process_words / process_characters; words are joined by spaces, characters by nothing)."""
    import jiwer

    out = (jiwer.process_words if unit == "words" else jiwer.process_characters)(ref, hyp)
    refs, hyps, sep = out.references[0], out.hypotheses[0], " " if unit == "words" else ""
    ops = {"equal": "=", "substitute": "S", "delete": "D", "insert": "I"}
    return [[ops[c.type], sep.join(refs[c.ref_start_idx:c.ref_end_idx]), sep.join(hyps[c.hyp_start_idx:c.hyp_end_idx])]
            for c in out.alignments[0]]


def error_rates(ref: str, hyp: str) -> dict:
    """One utterance's WER and CER (jiwer; an empty reference has none: None) and its marked edits."""
    import jiwer

    if not ref.strip():
        return {"wer": None, "cer": None, "edits": [["I", "", hyp]] if hyp else []}
    return {"wer": jiwer.wer(ref, hyp), "cer": jiwer.cer(ref, hyp), "edits": edit_segments(ref, hyp)}


def files_dir(report: Path) -> Path:
    """The folder beside `report` (x.html → x_files/) that its rows point into."""
    return report.with_name(report.stem + "_files")


def place(src: str | Path, report: Path, name: str) -> str:
    """`src` linked (or copied, across file systems) into the report's files folder as `name`; → the
    path the page uses (relative to the report). An existing file of that name is replaced."""
    dest = files_dir(report) / name
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.unlink(missing_ok=True)
    try:
        os.link(src, dest)
    except OSError:  # another file system, or links not allowed there
        shutil.copyfile(src, dest)
    return dest.relative_to(report.parent).as_posix()


def training_curves(metrics: Path, report: Path) -> str | None:
    """tools.plot's figure of a run's metrics.jsonl (every numeric key) as a PNG beside the report;
    → its relative path, or None when the run has no metrics.jsonl (a copied final/) or no rows."""
    from tools import plot

    rows = plot.read_metrics(metrics) if metrics.is_file() else []
    keys = plot.default_keys(rows)
    if not keys:
        return None
    dest = files_dir(report) / "training_curves.png"
    dest.parent.mkdir(parents=True, exist_ok=True)
    plot.plot(rows, keys).savefig(dest, format="png", dpi=80)
    return dest.relative_to(report.parent).as_posix()


def write_report(report: Path, title: str, summary: dict, columns: list[tuple[str, str, str]], rows: list[dict],
                 command: str | None = None, figures: list[tuple[str, str]] = (), sort: str | None = None) -> Path:
    """Write the page (atomically). `summary`: the dict the tool writes as JSON (its scalars are the
    headline); `figures`: (caption, relative path) images shown above the table; `sort`: the column
    the table is sorted by when it opens, worst first (e.g. "wer")."""
    report = Path(report)
    data = {"columns": [{"key": k, "label": label, "kind": kind} for k, label, kind in columns], "rows": rows,
            "sort": sort, "page_size": PAGE_SIZE}
    # "</" inside the JSON would end the <script> element early: escaped as "<\/" (the same string in JSON)
    blob = json.dumps(data, ensure_ascii=False, allow_nan=False, default=_finite).replace("</", "<\\/")
    heads = "".join(f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_shown(v))}</td></tr>"
                    for k, v in summary.items())
    figs = "".join(f'<figure><img src="{html.escape(src)}" alt="{html.escape(cap)}"><figcaption>{html.escape(cap)}'
                   f"</figcaption></figure>" for cap, src in figures)
    cmd = f"<pre class=cmd>{html.escape(command)}</pre>" if command else ""
    page = (f"<!doctype html><html lang=en><head><meta charset=utf-8><title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body><h1>{html.escape(title)}</h1>{cmd}"
            f"<table class=summary>{heads}</table>{figs}{LEGEND}"
            f'<div id=pager></div><table id=rows class=rows></table>'
            f'<script id=data type="application/json">{blob}</script><script>{JS}</script></body></html>')
    tmp = report.with_name(f".{report.name}.tmp")
    tmp.write_text(page, encoding="utf-8")
    os.replace(tmp, report)  # readers see the old page or the new one, never half of one
    return report


def _finite(value):
    """json.dumps's fallback: numpy scalars as Python numbers (NaN and inf are refused by allow_nan)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"a report cell cannot hold {type(value).__name__}: {value!r}")


def _shown(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


LEGEND = ('<p class=legend>Errors: <span class=S><del>ref</del><ins>hyp</ins></span> substitution, '
          '<span class=D><del>ref</del></span> deletion, <span class=I><ins>hyp</ins></span> insertion. '
          'Click a column to sort by it (again: reverse).</p>')

CSS = """
body{font:14px system-ui,sans-serif;margin:1.5em;color:#222}
pre.cmd{background:#f4f4f4;padding:.6em;white-space:pre-wrap;word-break:break-all}
table{border-collapse:collapse}td,th{border:1px solid #ddd;padding:3px 6px;vertical-align:top;text-align:left}
table.rows th{cursor:pointer;background:#f0f0f0;position:sticky;top:0}
th.asc::after{content:" \\25B2"}th.desc::after{content:" \\25BC"}
td.num{text-align:right;font-variant-numeric:tabular-nums}
figure{display:inline-block;margin:.5em}figure img{max-width:900px}td img{max-width:420px}
del{background:#fdd;text-decoration:line-through}ins{background:#dfd;text-decoration:none}
.S del{background:#fed}.S ins{background:#fe9;margin-left:.25em}.legend{color:#555}
#pager button{margin:0 .3em}
"""

# The table: a page of rows at a time from the embedded JSON; every cell is built with textContent or
# attributes (never innerHTML of data), so a transcript with "<" in it is shown, not run.
JS = r"""
(function(){
const D=JSON.parse(document.getElementById('data').textContent);
const table=document.getElementById('rows'),pager=document.getElementById('pager');
let rows=D.rows.slice(),page=0,sortKey=null,desc=true;
function el(tag,text,cls){const e=document.createElement(tag);if(text!=null)e.textContent=text;if(cls)e.className=cls;return e;}
function cell(col,v){
  const td=el('td');
  if(v==null||v===''){td.textContent='–';return td;}
  if(col.kind==='num'){td.className='num';td.textContent=Number(v).toFixed(3);}
  else if(col.kind==='pct'){td.className='num';td.textContent=(100*v).toFixed(1)+' %';}
  else if(col.kind==='audio'){const a=el('audio');a.controls=true;a.preload='none';a.src=v;td.appendChild(a);}
  else if(col.kind==='link'){const a=el('a',v);a.href=v;td.appendChild(a);}
  else if(col.kind==='image'){const i=el('img');i.loading='lazy';i.src=v;i.alt=col.label;td.appendChild(i);}
  else if(col.kind==='edits'){for(const [op,r,h] of v){
      const s=el('span',null,op==='='?'E':op);
      if(op==='='){s.textContent=r;}else{if(r)s.appendChild(el('del',r));if(h)s.appendChild(el('ins',h));}
      td.appendChild(s);td.appendChild(document.createTextNode(' '));}}
  else td.textContent=String(v);
  return td;}
function render(){
  table.textContent='';
  const head=el('tr');
  D.columns.forEach(c=>{const th=el('th',c.label);th.dataset.key=c.key;
    if(c.key===sortKey)th.className=desc?'desc':'asc';
    th.onclick=()=>{desc=(sortKey===c.key)?!desc:true;sortBy(c.key);};head.appendChild(th);});
  table.appendChild(head);
  const n=Math.max(1,Math.ceil(rows.length/D.page_size));page=Math.min(page,n-1);
  for(const r of rows.slice(page*D.page_size,(page+1)*D.page_size)){
    const tr=el('tr');tr.dataset.id=r.id;D.columns.forEach(c=>tr.appendChild(cell(c,r[c.key])));table.appendChild(tr);}
  pager.textContent=`${rows.length} rows, page ${page+1} of ${n} `;
  const b=(t,p)=>{const x=el('button',t);x.disabled=p<0||p>=n||p===page;x.onclick=()=>{page=p;render();};pager.appendChild(x);};
  b('first',0);b('previous',page-1);b('next',page+1);b('last',n-1);}
function sortBy(key){
  sortKey=key;const kind=D.columns.find(c=>c.key===key).kind;
  const val=r=>{const v=r[key];if(kind==='edits')return v?v.filter(e=>e[0]!=='=').length:null;return v;};
  rows.sort((a,b)=>{const x=val(a),y=val(b);
    if(x==null&&y==null)return 0;if(x==null)return 1;if(y==null)return -1;  // empty cells last either way
    const o=(typeof x==='number'&&typeof y==='number')?x-y:String(x).localeCompare(String(y));
    return desc?-o:o;});
  page=0;render();}
if(D.sort)sortBy(D.sort);else render();
})();
"""
