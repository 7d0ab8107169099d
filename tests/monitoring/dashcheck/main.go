// Command dashcheck decodes Grafana dashboard JSON files strictly against the schema's types in
// grafana-foundation-sdk (unknown fields, wrong types and missing required fields are errors)
// and runs their Validate methods; it prints OK or FAIL with the errors per file and exits 1
// on any error.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"strings"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/variants"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
	"github.com/grafana/grafana-foundation-sdk/go/stat"
	"github.com/grafana/grafana-foundation-sdk/go/table"
	"github.com/grafana/grafana-foundation-sdk/go/timeseries"
)

// msgs splits an error into lines with a prefix. The SDK's UnmarshalJSONStrict
// returns an empty cog.BuildErrors (a non-nil error) on success, so "" means OK.
func msgs(prefix string, err error) []string {
	if err == nil || err.Error() == "" {
		return nil
	}
	out := strings.Split(err.Error(), "\n")
	for i := range out {
		out[i] = prefix + out[i]
	}
	return out
}

type rawPanel struct {
	Type        string            `json:"type"`
	FieldConfig json.RawMessage   `json:"fieldConfig"`
	Panels      []json.RawMessage `json:"panels"`
}

// checkPanel re-decodes one panel itself: in v0.0.22 PanelOrRowPanel drops every
// panel (typed-nil error bug), so Dashboard.Validate never reaches panels.
func checkPanel(at string, raw json.RawMessage) []string {
	var rp rawPanel
	if err := json.Unmarshal(raw, &rp); err != nil {
		return []string{at + ": " + err.Error()}
	}
	if rp.Type == "row" {
		var errs []string
		for i, child := range rp.Panels {
			errs = append(errs, checkPanel(fmt.Sprintf("%s.panels[%d]", at, i), child)...)
		}
		return errs
	}
	p := dashboard.Panel{}
	_ = p.UnmarshalJSONStrict(raw) // its errors already come from Dashboard.UnmarshalJSONStrict
	errs := msgs(at+": validate: ", p.Validate())
	if _, ok := cog.ConfigForPanelcfgVariant(p.Type); !ok {
		errs = append(errs, at+": panel type "+p.Type+" not registered, options unchecked")
	}
	if v, ok := p.Options.(interface{ Validate() error }); ok {
		errs = append(errs, msgs(at+".options: validate: ", v.Validate())...)
	}
	for j, t := range p.Targets {
		if _, unknown := t.(variants.UnknownDataquery); unknown {
			errs = append(errs, fmt.Sprintf("%s.targets[%d]: unknown datasource type, unchecked", at, j))
		}
	}
	if rp.FieldConfig != nil { // Panel decodes fieldConfig leniently except defaults.custom
		fc := dashboard.FieldConfigSource{}
		errs = append(errs, msgs(at+".fieldConfig: ", fc.UnmarshalJSONStrict(rp.FieldConfig))...)
	}
	return errs
}

func check(path string) []string {
	raw, err := os.ReadFile(path)
	if err != nil {
		return []string{err.Error()}
	}
	d := dashboard.Dashboard{}
	errs := msgs("decode: ", d.UnmarshalJSONStrict(raw))
	errs = append(errs, msgs("validate: ", d.Validate())...)
	var top struct{ Panels []json.RawMessage }
	if err := json.Unmarshal(raw, &top); err != nil {
		return append(errs, err.Error())
	}
	for i, p := range top.Panels {
		errs = append(errs, checkPanel(fmt.Sprintf("panels[%d]", i), p)...)
	}
	return errs
}

func main() {
	rt := cog.NewRuntime()
	rt.RegisterPanelcfgVariant(timeseries.VariantConfig())
	rt.RegisterPanelcfgVariant(stat.VariantConfig())
	rt.RegisterPanelcfgVariant(table.VariantConfig())
	rt.RegisterDataqueryVariant(prometheus.VariantConfig())
	failed := false
	for _, path := range os.Args[1:] {
		if errs := check(path); len(errs) > 0 {
			failed = true
			fmt.Printf("FAIL %s\n  %s\n", path, strings.Join(errs, "\n  "))
		} else {
			fmt.Printf("OK   %s\n", path)
		}
	}
	if failed {
		os.Exit(1)
	}
}
