"""How the page looks: its stylesheet and the script that fits charts to their blocks
(given to ``gr.Blocks.launch`` by :func:`ui.app.launch`)."""

#: the page's stylesheet (classes ft-*: status card, progress bar, errors, charts)
CSS = """
.gradio-container {width: 100% !important; max-width: 1240px !important; margin: auto;}
.gradio-container .tabs, .gradio-container .tabitem {width: 100%;}
#ft-title h1 {margin-bottom: 0; font-size: 1.7em;}
#ft-title p {margin-top: 2px; color: var(--body-text-color-subdued);}
.ft-status {padding: 10px 14px; border: 1px solid var(--border-color-primary); border-radius: 10px;
            background: var(--block-background-fill);}
.ft-head {display: flex; justify-content: space-between; align-items: baseline; margin-bottom: 8px;}
.ft-state {font-weight: 700; font-size: 1.1em;}
.ft-run {font-family: var(--font-mono); color: var(--body-text-color-subdued); font-size: .9em;}
.ft-progress {height: 14px; border-radius: 7px; background: var(--neutral-200); overflow: hidden;}
.ft-bar {height: 100%; border-radius: 7px; transition: width .6s ease;}
.ft-facts {margin-top: 8px; font-size: .95em;}
.ft-muted {color: var(--body-text-color-subdued); font-size: .9em; margin-top: 4px;}
.ft-error {margin-top: 8px; padding: 8px 10px; border-radius: 8px; background: #fef2f2; color: #991b1b;
           white-space: pre-wrap; font-family: var(--font-mono); font-size: .85em;}
.ft-terminal {margin-top: 8px; padding: 6px 10px; border-radius: 8px; background: #fffbeb; color: #92400e; font-size: .9em;}
.ft-step {font-size: .95em; color: var(--body-text-color-subdued); margin-bottom: 4px;}
/* charts (Vega-Lite, SVG, views.chart): as wide as their block, text in the theme's colour */
.ft-chart .vega-embed {width: 100%;}
.ft-chart g[class*="role-axis"] text, .ft-chart g[class*="role-legend"] text, .ft-chart g[class*="role-title"] text
  {fill: var(--body-text-color);}
/* the Data tab's preference pairs side by side (views.pairs_html): texts wrap, never cut */
.ft-pairs-title {font-size: .9em; color: var(--body-text-color-subdued); margin: 0 0 6px 2px;}
table.ft-pairs {width: 100%; table-layout: fixed; border-collapse: collapse; font-size: .9em;}
table.ft-pairs th {text-align: left; padding: 6px 8px; border-bottom: 2px solid var(--border-color-primary);}
table.ft-pairs td {vertical-align: top; padding: 8px; border-bottom: 1px solid var(--border-color-primary);
                   white-space: pre-wrap; overflow-wrap: anywhere;}
table.ft-pairs td.ft-chosen {background: rgba(16, 185, 129, .10);}
table.ft-pairs td.ft-rejected {background: rgba(239, 68, 68, .08);}
table.ft-pairs .ft-msg + .ft-msg {margin-top: 4px;}
table.ft-pairs .ft-where {margin-top: 6px; font-size: .85em; color: var(--body-text-color-subdued);}
/* the YAML editor's line numbers: CodeMirror sizes them from line heights it measures only on
   screen; filled off screen (a hidden tab, below the fold) they took a 14 px guess while lines are
   taller, and drifted from the text. Each number now takes the height of its line. */
#recipe-yaml .cm-lineNumbers .cm-gutterElement:not([style*="visibility"]) {height: auto !important;}
/* a chat lane's title above its messages, not floating over them as they scroll; nor its
   one-lane trash button (the Clear button below clears both lanes) */
.ft-lane-title {margin: 0 0 -4px 4px;}
#chat-tuned .top-panel, #chat-base .top-panel {display: none;}
/* a narrow checkbox's help names recipe keys (model.trust_remote_code) longer than its column: they wrap, not overflow */
#export-allow-code, #chat-allow-code, #export-allow-code *, #chat-allow-code * {overflow-wrap: anywhere; min-width: 0;}
"""

#: On page load: a chart whose block changes width (its tab shown, the window resized) is fitted
#: to it again. Vega measures a "container" width on window resize events only, and a chart drawn
#: in a hidden tab is drawn zero-wide.
JS = """() => {
  const fit = new ResizeObserver(() => window.dispatchEvent(new Event("resize")));
  const seen = new WeakSet();
  const watch = () => document.querySelectorAll(".ft-chart").forEach(el => { if (!seen.has(el)) { seen.add(el); fit.observe(el); } });
  watch();
  new MutationObserver(watch).observe(document.body, {childList: true, subtree: true});
}"""
